"""Issue 18: two nodes without a shared volume, simulated as two torchrun launchers on loopback
(`--nnodes 2 --node-rank i`), each with its own --save-folder, and a real SeaweedFS. Sharded (FSDP2):
each node writes its ranks' part to its own disk and uploads it; the bucket holds a complete
checkpoint only once both parts are there. DDP: rank 0's node writes and uploads the replicated state.
Then one node of three ranks, on new disks, resumes from the bucket.
"""
from __future__ import annotations

import json
import shutil
import signal
import socket
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.faultproxy import FaultProxy
from tests.support.jobs import REPO, JobProcess, events, inspect, job_env, s3_job_env
from tests.support.polling import wait_until
from tests.support.s3server import Bucket, fast_config
from uploader.local import FINISHED_NAME, checkpoint_name, is_node_part, list_committed
from uploader.manifest import DCP_METADATA
from uploader.remote import open_remote
from uploader.sync import list_remote, list_set_aside, pull_newest

pytestmark = [pytest.mark.slow, pytest.mark.s3]

# A global batch of 96 (48 x 2 ranks) that 3 ranks can share on the restart.
ARGS = ["--model", "tests.support.slow_model:build", "--max-duration", "60ba", "--eval-interval", "1000ba",
        "--save-interval", "10ba", "--log-interval", "2", "--seed", "5", "--log-format", "json", "--sync-save",
        "--batch-size", "48", "--grad-accum", "2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node(i: int, nodes: int, endpoint: str, run_id: str, folder: Path, remote: str | None, env: dict[str, str],
         mode: list[str], per_node: int = 1, cwd: Path | None = None) -> JobProcess:
    """``cwd`` with a relative ``folder``: a path that names another folder on each node, as on two machines."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(i),
            "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "-m", "job", "train", *ARGS, *mode, "--save-folder", str(folder),
            *(["--remote", remote] if remote is not None else [])]
    return JobProcess(argv, env={**env, "PYTHONPATH": str(REPO)} if cwd is not None else env,
                      **({"cwd": cwd} if cwd is not None else {}))


def bucket_object(bucket: Bucket, key: str) -> bytes:
    remote = open_remote(bucket.url("run"), fast_config(bucket.endpoint_url))
    try:
        return remote.read_bytes(key) or b""
    finally:
        remote.close()


def complete(bucket: Bucket) -> list[int]:
    remote = open_remote(bucket.url("run"), fast_config(bucket.endpoint_url))
    try:
        return [c.step for c in list_remote(remote) if c.complete]
    finally:
        remote.close()


@pytest.mark.parametrize("mode", [["--sharded"], []], ids=["sharded", "ddp"])
def test_two_nodes_without_a_shared_volume_checkpoint_through_the_bucket_and_resume_on_one(
    tmp_path: Path, s3_bucket: Bucket, mode: list[str]
) -> None:
    env, remote = s3_job_env(s3_bucket), s3_bucket.url("run")
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    folders = [tmp_path / f"node{i}" for i in range(2)]
    procs = [node(i, 2, endpoint, run_id, folders[i], remote, env, mode) for i in range(2)]
    stop_when(procs, lambda: procs[0].wait_event("checkpoint", lambda e: e["step"] >= 20, timeout=240))
    stopped = [e for p in procs for e in events(p.stderr) if e.get("event") == "preempted"]
    assert len(stopped) >= 1 and len({e["checkpoint_step"] for e in stopped}) == 1, procs[0].stderr[-3000:]
    stop_step = stopped[0]["checkpoint_step"]
    assert stop_step in complete(s3_bucket)  # the bucket holds the whole of the stop step
    whole = json.loads(bucket_object(s3_bucket, f"{checkpoint_name(stop_step)}/manifest.json"))
    if mode:  # sharded: each node holds only its own part, and the bucket both parts
        for i, folder in enumerate(folders):
            part = list_committed(folder)[-1].manifest()
            assert (part.step, part.meta["node"], part.meta["nodes"]) == (stop_step, i, 2)
            assert any(f.path == f"__{i}_0.distcp" for f in part.files)
            assert not any(f.path == f"__{1 - i}_0.distcp" for f in part.files)
        assert {"__0_0.distcp", "__1_0.distcp", "dcp-metadata.json"} <= {f["path"] for f in whole["files"]}
        assert whole["meta"]["nodes"] == 2 and "node" not in whole["meta"]
    else:  # DDP: the replicated state is written once, by rank 0's node; node 1's disk stays empty
        assert [f["path"] for f in whole["files"]] == ["state.pt"]
        assert list_committed(folders[1]) == []

    # New disks, one node of 3 ranks: it resumes from the bucket (resharded when sharded) and finishes.
    fresh = tmp_path / "fresh"
    again = node(0, 1, f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8], fresh, remote, env, mode, per_node=3)
    assert again.wait(300) == 0, again.stderr[-3000:]
    resumed = [e for e in events(again.stderr) if e.get("event") == "resumed"]
    assert resumed and resumed[0]["step"] == stop_step and resumed[0]["source"].startswith(remote)
    assert (resumed[0]["world_size_was"], resumed[0]["world_size"]) == (2, 3)
    assert max(complete(s3_bucket)) == 60
    assert inspect(fresh)["step"] == 60


def test_a_node_killed_while_it_uploads_never_leaves_that_step_complete(
    tmp_path: Path, s3_bucket: Bucket, fault_proxy: FaultProxy
) -> None:
    """Node 1 reaches the bucket through a proxy that holds its requests for step 20's keys: its part of
    step 20 is on its way when both nodes are SIGKILLed. Step 20 must not be complete, and a restart
    resumes from step 10.

    The proxy used to slow node 1's link once the test saw step 10 complete. Step 20 is about half a
    second of training later, so under load node 1 had sometimes uploaded its part of step 20 before
    the link turned slow, and step 20 was complete."""
    env, remote = s3_job_env(s3_bucket), s3_bucket.url("run")
    slow_env = {**env, "JOB_ENDPOINT_URL": fault_proxy.endpoint_url}
    fault_proxy.hold("/step-000000000020/")
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    procs = [node(i, 2, endpoint, run_id, tmp_path / f"node{i}", remote, (env, slow_env)[i], ["--sharded"])
             for i in range(2)]
    try:
        wait_until(lambda: fault_proxy.counters.held > 0, timeout=240, interval=0.2,
                   what="node 1 uploading its part of step 20")
        wait_until(lambda: 10 in complete(s3_bucket), timeout=60, interval=0.5, what="step 10 complete in the bucket")
        for proc in reversed(procs):
            proc.kill()  # SIGKILL, launcher and workers: no goodbye
    finally:
        for proc in procs:
            proc.kill()
    assert 20 not in complete(s3_bucket) and max(complete(s3_bucket)) == 10

    again = node(0, 1, f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8], tmp_path / "fresh", remote, env,
                 ["--sharded"], per_node=2)
    assert again.wait(300) == 0, again.stderr[-3000:]
    resumed = [e for e in events(again.stderr) if e.get("event") == "resumed"]
    assert [e["step"] for e in resumed] == [10]


def two_nodes(folders: list[Path], remote: str | None, env: dict[str, str], *flags: str) -> list[JobProcess]:
    """A sharded job on two nodes of one rank each, started now."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    return [node(i, 2, endpoint, run_id, folders[i], remote, env, ["--sharded", *flags]) for i in range(2)]


def stop_when(procs: list[JobProcess], ready: Callable[[], object], which: list[JobProcess] | None = None) -> None:
    """Once ``ready()`` returns, SIGTERM to the launchers ``which`` (all by default), and every launcher waited
    for: torchrun itself exits 1 on SIGTERM, its workers' events say how they stopped. None outlives this."""
    try:
        ready()
        for proc in procs if which is None else which:
            proc.signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(240)
    finally:
        for proc in procs:
            proc.kill()


def ended(procs: list[JobProcess]) -> list[tuple[str, int | None]]:
    """How each worker's start ended: its ``preempted``, ``resumed`` or ``failed`` event, with the step."""
    return [(e["event"], e["step"]) for p in procs for e in events(p.stderr)
            if e.get("event") in ("preempted", "resumed", "failed")]


def finish(procs: list[JobProcess]) -> list[dict]:
    """Wait for every launcher to exit 0; their events."""
    try:
        for proc in procs:
            assert proc.wait(300) == 0, proc.stderr[-3000:]
    finally:
        for proc in procs:
            proc.kill()
    return [e for p in procs for e in events(p.stderr)]


def final_model(bucket: Bucket, prefix: str, folder: Path) -> str:
    """The model_sha256 of the newest whole checkpoint under ``prefix``, pulled into ``folder``."""
    remote = open_remote(bucket.url(prefix), fast_config(bucket.endpoint_url))
    try:
        pulled = pull_newest(remote, folder)
    finally:
        remote.close()
    assert pulled is not None
    return inspect(pulled.path)["model_sha256"]


def test_each_node_downloads_only_what_its_ranks_read_and_the_resume_is_bit_exact(
    tmp_path: Path, s3_bucket: Bucket
) -> None:
    """Issue 18 point 3: two nodes resume a two-node sharded checkpoint from the bucket on new disks, each
    downloading its own shard file and the small shared files, never the other node's shard; the run
    ends bit for bit where an uninterrupted one does. Then a shard in the bucket goes bad: the node that
    reads it fails its verification, the checkpoint is set aside, and both nodes resume the one before."""
    env = s3_job_env(s3_bucket)
    straight = finish(two_nodes([tmp_path / "straight0", tmp_path / "straight1"], s3_bucket.url("straight"), env))
    assert not [e for e in straight if e.get("event") == "resumed"]

    procs = two_nodes([tmp_path / "a0", tmp_path / "a1"], s3_bucket.url("run"), env)
    stop_when(procs, lambda: procs[0].wait_event("checkpoint", lambda e: e["step"] >= 20, timeout=240))
    stopped = [e for p in procs for e in events(p.stderr) if e.get("event") == "preempted"]
    assert stopped and len({e["checkpoint_step"] for e in stopped}) == 1, procs[0].stderr[-3000:]
    stop_step = stopped[0]["checkpoint_step"]
    assert max(complete(s3_bucket)) == stop_step
    whole = json.loads(bucket_object(s3_bucket, f"{checkpoint_name(stop_step)}/manifest.json"))
    sizes = {f["path"]: f["size"] for f in whole["files"]}

    resumed = finish(two_nodes([tmp_path / "b0", tmp_path / "b1"], s3_bucket.url("run"), env))
    assert [e["step"] for e in resumed if e.get("event") == "resumed"] == [stop_step, stop_step]
    pulls = {e["node"]: e for e in resumed if e.get("event") == "pulled"}
    assert sorted(pulls) == [0, 1] and all(p["step"] == stop_step and p["of_bytes"] == sum(sizes.values())
                                           for p in pulls.values())
    for i, pulled in pulls.items():  # its own shard, not the other node's: less than the whole, by that file
        assert sizes[f"__{i}_0.distcp"] <= pulled["bytes"] <= sum(sizes.values()) - sizes[f"__{1 - i}_0.distcp"]
    assert not list((tmp_path / "b1").glob(".resume-*"))  # the scratch download is gone after the load
    assert final_model(s3_bucket, "run", tmp_path / "run-final") == final_model(s3_bucket, "straight",
                                                                               tmp_path / "straight-final")

    # Node 1's shard of step 60 rots in the bucket (same size, other bytes). The one before it in the bucket is
    # 50 when every save went up; a save taken while a node was still uploading stays local (job.checkpoint).
    before = max(step for step in complete(s3_bucket) if step < 60)
    remote = open_remote(s3_bucket.url("run"), fast_config(s3_bucket.endpoint_url))
    try:
        key = f"{checkpoint_name(60)}/__1_0.distcp"
        data = remote.read_bytes(key)
        assert data is not None
        remote.write_bytes(key, bytes(len(data)))
    finally:
        remote.close()
    again = finish(two_nodes([tmp_path / "c0", tmp_path / "c1"], s3_bucket.url("run"), env))
    assert [e["step"] for e in again if e.get("event") == "resumed"] == [before, before]
    assert 60 in complete(s3_bucket)  # trained again from there and committed anew
    remote = open_remote(s3_bucket.url("run"), fast_config(s3_bucket.endpoint_url))
    try:
        assert [name for name in list_set_aside(remote) if name.startswith(f"corrupt-{checkpoint_name(60)}-")]
    finally:
        remote.close()


QUICK = ("--model", "mlp", "--max-duration", "20ba")  # the built-in model: these tests time nothing


def test_a_stop_while_each_node_downloads_its_part_ends_every_node_at_once(
    tmp_path: Path, s3_bucket: Bucket, fault_proxy: FaultProxy
) -> None:
    """A spot reclaim of both nodes while each downloads its part of the checkpoint to resume (job.node_pull):
    nothing is trained yet, so each worker stops at once with exit 75, as one node does during its start-up
    pull. The node downloads were waited for to their end: a held one ended with the retry budget, exit 5,
    long after any grace period."""
    env = s3_job_env(s3_bucket)
    finish(two_nodes([tmp_path / "a0", tmp_path / "a1"], s3_bucket.url("run"), env, *QUICK))
    assert complete(s3_bucket) == [10, 20]
    fault_proxy.hold(DCP_METADATA)  # each node leader's first file of the resume
    folders = [tmp_path / "b0", tmp_path / "b1"]
    procs = two_nodes(folders, s3_bucket.url("run"), {**env, "JOB_ENDPOINT_URL": fault_proxy.endpoint_url},
                      *QUICK, "--max-duration", "40ba", "--grace-period", "30")
    stop_when(procs, lambda: wait_until(lambda: fault_proxy.counters.held >= 2, timeout=120,
                                        what="both nodes' downloads held"))
    assert ended(procs) == [("preempted", None), ("preempted", None)], procs[0].stderr[-3000:]
    for folder in folders:
        assert (folder / FINISHED_NAME).exists()  # each node's sidecar may leave
        assert list_committed(folder) == [] and not list(folder.glob(".resume-*"))  # no scratch left
    assert complete(s3_bucket) == [10, 20]  # the checkpoint being pulled is as it was, for the next start


def test_a_node_stopped_while_another_still_downloads_its_part_ends_every_node_at_once(
    tmp_path: Path, s3_bucket: Bucket, fault_proxy: FaultProxy
) -> None:
    """Node 0 has its part of the checkpoint and waits for node 1's, held in the bucket, when node 0 alone is
    reclaimed (job.node_pull). It waited in gloo's collective, where no signal handler runs, until node 1's
    download gave up: exit 5, minutes past the grace period (review 49, defect 6). Now node 0 leaves the wait
    at once, and node 1 gives its download up on hearing it: both exit 75, nothing trained, the bucket as
    it was."""
    env = s3_job_env(s3_bucket)
    finish(two_nodes([tmp_path / "a0", tmp_path / "a1"], s3_bucket.url("run"), env, *QUICK))
    fault_proxy.hold("__1_0.distcp")  # node 1's shard: node 0 reads only its own and the metadata
    folders = [tmp_path / "b0", tmp_path / "b1"]
    procs = two_nodes(folders, s3_bucket.url("run"), {**env, "JOB_ENDPOINT_URL": fault_proxy.endpoint_url},
                      *QUICK, "--max-duration", "40ba", "--grace-period", "30")

    def node_0_waits() -> bool:
        """Node 0 asked for its part, node 1's is held. Node 0 may still be reading the last bytes: a stop
        then ends its download, and it leaves through the same wait all the same."""
        return bool(fault_proxy.counters.held) and any("__0_0.distcp" in line
                                                       for line in fault_proxy.counters.request_lines)

    stop_when(procs, lambda: wait_until(node_0_waits, timeout=120, what="node 0's part asked for, node 1's held"),
              which=procs[:1])
    assert ended(procs) == [("preempted", None), ("preempted", None)], procs[1].stderr[-3000:]
    assert fault_proxy.counters.held == 1  # node 1 gave its download up at once: never timed out and asked again
    for folder in folders:
        assert (folder / FINISHED_NAME).exists() and not list(folder.glob(".resume-*"))
    assert complete(s3_bucket) == [10, 20]


def test_a_restart_with_the_same_resume_path_still_downloads_only_each_nodes_part(
    tmp_path: Path, s3_bucket: Bucket
) -> None:
    """--resume PATH seeds a run; restarted with the same flags once the bucket holds the run's own, it resumes
    those through job.node_pull like --resume auto. Rank 0 alone had switched to auto, past node_pull: it
    downloaded the whole checkpoint, and every other node did too (review 49)."""
    env = s3_job_env(s3_bucket)
    finish(two_nodes([tmp_path / "a0", tmp_path / "a1"], s3_bucket.url("run"), env, *QUICK))
    remote = open_remote(s3_bucket.url("run"), fast_config(s3_bucket.endpoint_url))
    try:
        seed = pull_newest(remote, tmp_path / "seed", step=10)
    finally:
        remote.close()
    assert seed is not None

    done = finish(two_nodes([tmp_path / "b0", tmp_path / "b1"], s3_bucket.url("run"), env, *QUICK[:2],
                            "--max-duration", "30ba", "--resume", str(seed.path)))

    assert sorted((e["node"], e["step"]) for e in done if e.get("event") == "pulled") == [(0, 20), (1, 20)]
    assert [e["step"] for e in done if e.get("event") == "resumed"] == [20, 20]
    assert any(e.get("message", "").startswith(f"--resume {seed.path} is not used") for e in done)


@pytest.mark.parametrize("reclaimed", [1, 0], ids=["the-pulling-node", "the-waiting-node"])
def test_a_stop_while_another_node_pulls_the_whole_checkpoint_ends_every_rank_with_75(
    tmp_path: Path, s3_bucket: Bucket, fault_proxy: FaultProxy, reclaimed: int
) -> None:
    """Node 0 holds the newest whole checkpoint; node 1 downloads it from the bucket (job.resume
    _whole_on_this_node), and one of them is reclaimed meanwhile. Node 1's stop ended rank 0, waiting in a
    barrier, with "unexpected error (a bug)" and exit 1 (review 49). Node 0's stop went unanswered while it
    waited in gloo's collective, until node 1's held download gave up: exit 5, minutes past any grace period
    (review 49, defect 6). Now every rank ends as the stopped node does, and at once (job.leavable)."""
    env = s3_job_env(s3_bucket)
    finish(two_nodes([tmp_path / "a0", tmp_path / "a1"], s3_bucket.url("run"), env, *QUICK))
    remote = open_remote(s3_bucket.url("run"), fast_config(s3_bucket.endpoint_url))
    disks = [tmp_path / "disk0", tmp_path / "disk1"]  # ck names another folder on each node
    try:
        assert pull_newest(remote, disks[0] / "ck") is not None  # node 0's disk holds step 20 whole
    finally:
        remote.close()
    disks[1].mkdir()
    fault_proxy.hold(".distcp")
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    envs = (env, {**env, "JOB_ENDPOINT_URL": fault_proxy.endpoint_url})
    procs = [node(i, 2, endpoint, run_id, Path("ck"), s3_bucket.url("run"), envs[i],
                  ["--sharded", *QUICK[:2], "--max-duration", "40ba", "--grace-period", "30"], cwd=disks[i])
             for i in range(2)]
    stop_when(procs, lambda: wait_until(lambda: fault_proxy.counters.held > 0, timeout=120,
                                        what="node 1's download held"), which=[procs[reclaimed]])
    assert ended(procs) == [("preempted", None), ("preempted", None)], procs[1 - reclaimed].stderr[-3000:]
    assert "unexpected error" not in procs[0].stderr
    assert fault_proxy.counters.held == 1  # node 1 gave its download up at once: never timed out and asked again


def test_nodes_back_on_their_own_disks_with_no_whole_checkpoint_in_the_bucket_start_again(tmp_path: Path) -> None:
    """Each disk holds its node's parts of steps 10 and 20, and the bucket none (they never met there: the
    uploads died with the nodes). A part alone is never resumed, so the run starts again from step 0. It
    once exited 6 at every start ("none of the 2 checkpoint(s) verifies"), with advice (--resume never)
    that the folder's parts then refused. A save that died half-way on node 1 left a staging folder, which
    only rank 0's start-up used to remove: each node's first process now removes its own."""
    folders, bucket = [tmp_path / "node0", tmp_path / "node1"], tmp_path / "bucket"
    finish(two_nodes(folders, f"file://{bucket}", job_env(), *QUICK))
    assert [[c.step for c in list_committed(f)] for f in folders] == [[10, 20], [10, 20]]
    shutil.rmtree(bucket)
    leftover = folders[1] / ".staging-step-000000000030-sharded-12345"
    leftover.mkdir()
    (leftover / "__1_0.distcp").write_bytes(bytes(1000))

    done = finish(two_nodes(folders, f"file://{bucket}", job_env(), *QUICK[:2], "--max-duration", "30ba"))

    assert not [e for e in done if e.get("event") == "resumed"]
    assert [e["step"] for e in done if e.get("event") == "finished"] == [30, 30]
    assert not leftover.exists()
    uploaded = [c.step for c in list_committed(bucket)]  # 10 or 20 stays local when a node was still uploading
    assert uploaded[-1] == 30 and set(uploaded) <= {10, 20, 30}, uploaded


def test_nodes_with_their_own_disks_and_no_bucket_are_refused_at_start_up(tmp_path: Path) -> None:
    """Nothing such a run saves could be resumed: exit 2 at once, not a discovery at the first restart. With
    --upload off only the bucket's checkpoints can be (read-only credentials): a warning. On one volume
    that every node shares, rank 0 commits the whole checkpoint, and no bucket is needed."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    procs = two_nodes(folders, None, job_env(), *QUICK)
    codes = [proc.wait(120) for proc in procs]
    assert codes == [1, 1], procs[0].stderr[-3000:]  # torchrun's own; its worker's is 2
    for proc, folder in zip(procs, folders, strict=True):
        assert "exitcode  : 2" in proc.stderr
        assert [line for line in proc.stderr.splitlines() if line.startswith("job: error")] == [
            f"job: error: --sharded on 2 nodes whose --save-folder {folder} is a disk of each node's own "
            "needs --remote: each node keeps only its part of a checkpoint, and a part alone is never resumed; "
            "add --remote s3://bucket/prefix, or give every node one shared volume"]
        assert not list(folder.iterdir())  # the probe is gone

    off = finish(two_nodes(folders, f"file://{tmp_path / 'bucket'}", job_env(), *QUICK, "--upload", "off"))
    assert [e["step"] for e in off if e.get("event") == "finished"] == [20, 20]  # resume-only uses: a warning
    assert any("--upload off on 2 nodes with disks of their own" in e.get("message", "") for e in off)

    shared = tmp_path / "shared"
    done = finish(two_nodes([shared, shared], None, job_env(), *QUICK))
    assert [e["step"] for e in done if e.get("event") == "finished"] == [20, 20]
    assert [c.step for c in list_committed(shared)] == [10, 20] and not is_node_part(list_committed(shared)[-1])


def test_nodes_upload_the_same_steps_when_one_uploads_slower_than_they_save(
    tmp_path: Path, s3_bucket: Bucket, fault_proxy: FaultProxy
) -> None:
    """Node 1's link takes longer per part than the run takes between saves. Each node's uploader took the
    newest checkpoint whenever it was free, at other times on each node: node 0 uploaded all 120 saves,
    node 1 a few, and only steps both happened to pick were ever whole in the bucket. Now a save goes up
    only when no node is still uploading, so both upload the same steps, each of them whole, and the last
    one always."""
    env = s3_job_env(s3_bucket)
    fault_proxy.delay(0.1)  # per request: node 1's part of a step takes a second or more
    envs = (env, {**env, "JOB_ENDPOINT_URL": fault_proxy.endpoint_url})
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    procs = [node(i, 2, endpoint, run_id, tmp_path / f"node{i}", s3_bucket.url("run"), envs[i],
                  ["--sharded", "--model", "mlp", "--max-duration", "240ba", "--save-interval", "2ba", "--keep", "100",
                   "--log-interval", "40"]) for i in range(2)]
    finish(procs)
    uploaded = [[e["step"] for e in events(p.stderr) if e.get("event") == "uploaded"] for p in procs]
    saved = [e["step"] for e in events(procs[0].stderr) if e.get("event") == "checkpoint"]
    assert uploaded[0] == uploaded[1] and uploaded[0][-1] == 240, uploaded
    assert len(uploaded[0]) < len(saved) / 2  # node 1's link did hold the uploads back
    assert complete(s3_bucket) == uploaded[0]
