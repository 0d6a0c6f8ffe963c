"""The ``uploader`` command as a real subprocess: configuration by environment, output, exit codes."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.checkpoints import checkpoints_of, corrupt_file, data_files_of, files_of, make_checkpoint
from tests.support.disk import FILE_TOO_LARGE, limit_file_size, pull_refused
from tests.support.s3server import ADMIN, Bucket, isolated_aws_env
from tests.support.uploader_cli import cli_env, run_cli
from tests.support.users import NOBODY, as_nobody
from uploader.filesystem import FileRemote
from uploader.local import LocalCheckpoint, list_committed, list_set_aside
from uploader.manifest import MANIFEST_NAME
from uploader.sync import push


@pytest.mark.s3
def test_sync_ls_pull_round_trip(s3_bucket: Bucket, tmp_path: Path) -> None:
    local = tmp_path / "local"
    ckpts = [make_checkpoint(local, step) for step in (10, 20, 30)]
    env = cli_env(s3_bucket, keep="2")

    sync = run_cli(["sync", str(local), s3_bucket.url()], env)
    ls = run_cli(["ls", s3_bucket.url()], env)
    pull = run_cli(["pull", s3_bucket.url(), str(tmp_path / "restore")], env)

    assert sync.returncode == 0, sync.stderr
    assert all(json.loads(line)["level"] for line in sync.stderr.splitlines())  # JSON lines when not a TTY
    rows = [json.loads(line) for line in ls.stdout.splitlines()]
    assert [(r["step"], r["complete"]) for r in rows] == [(20, True), (30, True)]
    assert all(r["size"] > 0 and r["time"].endswith("Z") for r in rows)
    assert pull.returncode == 0, pull.stderr
    assert pull.stdout.strip() == str(tmp_path / "restore" / ckpts[-1].name)
    assert data_files_of(Path(pull.stdout.strip())) == data_files_of(ckpts[-1].path)


def test_pull_sets_a_corrupt_checkpoint_aside_and_ls_names_it(tmp_path: Path) -> None:
    remote_dir = tmp_path / "remote"
    url, env = f"file://{remote_dir}", isolated_aws_env(ADMIN)
    for step in (10, 20):
        make_checkpoint(tmp_path / "local", step)
    assert run_cli(["sync", str(tmp_path / "local"), url], env).returncode == 0
    corrupt_file(remote_dir / "step-000000000020" / "state.pt")

    pull = run_cli(["pull", url, str(tmp_path / "restore")], env)
    ls = run_cli(["ls", url], env)

    assert pull.returncode == 0 and pull.stdout.strip().endswith("step-000000000010"), pull.stderr
    assert [json.loads(line)["step"] for line in ls.stdout.splitlines()] == [10]
    (aside,) = [p.name for p in remote_dir.iterdir() if p.name.startswith("corrupt-")]
    assert aside.startswith("corrupt-step-000000000020-") and f"{url}/{aside}/ was set aside" in ls.stderr


def test_pull_with_no_checkpoint_exits_6_with_one_line(tmp_path: Path) -> None:
    result = run_cli(["pull", f"file://{tmp_path / 'empty'}", str(tmp_path / "restore")], isolated_aws_env(ADMIN))

    assert result.returncode == 6
    assert result.stderr.strip().splitlines() == [
        f"uploader: error: no complete checkpoint that verifies under file://{tmp_path / 'empty'} "
        f"(folder {str(tmp_path / 'empty')!r}); start from scratch or check the remote URL"
    ]


def test_pull_onto_a_full_disk_exits_7_with_one_line_and_changes_nothing(tmp_path: Path) -> None:
    remote_dir, restore = tmp_path / "remote", tmp_path / "restore"
    url, env = f"file://{remote_dir}", isolated_aws_env(ADMIN)
    ckpt = make_checkpoint(tmp_path / "local", 10)
    assert run_cli(["sync", str(tmp_path / "local"), url], env).returncode == 0
    before = data_files_of(remote_dir / ckpt.name)

    pull = run_cli(["pull", url, str(restore)], env, preexec_fn=limit_file_size(16 * 1024))

    assert pull.returncode == 7, pull.stderr
    assert pull.stderr.strip().splitlines()[-1] == "uploader: error: " + pull_refused(
        ckpt.name, ckpt.manifest().total_size, restore, FILE_TOO_LARGE)
    assert list(restore.iterdir()) == [] and data_files_of(remote_dir / ckpt.name) == before


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["ls", "ftp://host/path"], "unsupported remote"),
        (["ls", "file://relative/path"], "absolute"),
        (["--part-size", "1MiB", "ls", "file:///tmp/x"], "part_size"),
        (["--addressing", "sideways", "ls", "file:///tmp/x"], "sideways"),
        (["--endpoint-url", "127.0.0.1:9000", "ls", "s3://bucket/x"], "endpoint_url"),
        (["sync", "/nonexistent/spot-trainer-checkpoints", "file:///tmp/x"], "does not exist"),
        (["watch", "--poll-interval", "nan", "/tmp", "file:///tmp/x"], "'nan' is not a number of seconds"),
        (["watch", "--grace", "nan", "/tmp", "file:///tmp/x"], "--grace"),
        (["--connect-timeout", "1e308", "ls", "file:///tmp/x"], "--connect-timeout"),
        (["watch", "", "file:///tmp/x"], "'LOCAL': is empty; give a folder"),
        (["sync", " ", "file:///tmp/x"], "'LOCAL': is empty; give a folder"),
        (["--endpoint-url", "http://127.0.0.1:99999", "ls", "s3://bucket/x"], "a port between 1 and 65535"),
        (["ls", "s3://Not_A_Bucket!/x"], "'Not_A_Bucket!' in 's3://Not_A_Bucket!/x' is not a bucket name"),
    ],
    ids=["scheme", "relative-file-url", "part-size", "addressing", "endpoint-without-scheme", "sync-missing-local",
         "poll-interval-nan", "grace-nan", "timeout-beyond-a-wait", "watch-empty-local", "sync-blank-local",
         "endpoint-port", "bucket-name"],
)
def test_usage_errors_exit_2(args: list[str], says: str) -> None:
    result = run_cli(args, isolated_aws_env(ADMIN))

    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()  # one line, as every other error: not click's Usage/Try/Error
    assert line.startswith("uploader: error: ") and says in line and line.endswith(" --help')")


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"AWS_ENDPOINT_URL": "admin:SECRET-PASSWORD@127.0.0.1:9000"},
         "(ValueError: Invalid endpoint: ***@127.0.0.1:9000)"),
        ({"AWS_ENDPOINT_URL": "http://127.0.0.1:99999"},
         "Custom endpoint `http://127.0.0.1:99999` was not a valid URI"),
        ({"AWS_DEFAULT_REGION": "us east!"}, "Provided region_name 'us east!' doesn't match a supported format."),
    ],
    ids=["endpoint-with-a-password", "endpoint-port", "region"],
)
def test_settings_the_s3_client_refuses_from_the_environment_exit_2(env: dict[str, str], says: str) -> None:
    """Past the options' checks, botocore refused them with a traceback or as "Invalid value for REMOTE", the
    password in clear."""
    result = run_cli(["ls", "s3://bucket/x"], {**isolated_aws_env(ADMIN), **env})

    assert result.returncode == 2 and result.stdout == ""
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("uploader: error: the S3 client refuses its settings (") and says in line
    assert "SECRET-PASSWORD" not in result.stderr


def _folder_as_manifest(remote_dir: Path, ckpt: LocalCheckpoint) -> None:
    (remote_dir / ckpt.name / MANIFEST_NAME).mkdir(parents=True)


def _folder_as_data_file(remote_dir: Path, ckpt: LocalCheckpoint) -> None:
    (remote_dir / ckpt.name / "state.pt").mkdir(parents=True)



def _newer_format(remote_dir: Path, ckpt: LocalCheckpoint) -> None:
    push(ckpt, FileRemote(remote_dir), keep=3)
    manifest = remote_dir / ckpt.name / MANIFEST_NAME
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 4}))


# Remote steps an upload must not replace, with what the error line says.
NOT_REPLACED: dict[str, tuple[Callable[[Path, LocalCheckpoint], None], str]] = {
    "folder-as-manifest": (_folder_as_manifest, "step-000000000020/manifest.json is not a regular file"),
    "folder-as-data-file": (_folder_as_data_file, "step-000000000020/state.pt: Is a directory; something this "
                                                  "uploader did not write is in its place: remove it"),
    "newer-format": (_newer_format, "step-000000000020: manifest format_version 4 is not supported (this build "
                                    "reads [1, 2, 3]); upgrade spot-trainer"),
}


def _sync_unreadable(top: Path, unreadable: str) -> tuple[subprocess.CompletedProcess[str], LocalCheckpoint, Path]:
    """``uploader sync`` of a checkpoint whose ``unreadable`` (a path in it; "" for the folder) is mode 000,
    run by a user who does not own it; returns the run, the checkpoint and the remote folder."""
    os.chmod(top, 0o755)  # pytest's own tmp_path is the owner's alone (0700)
    local, remote_dir = top / "local", top / "remote"
    ckpt = make_checkpoint(local, 4)
    remote_dir.mkdir()
    args = ["sync", str(local), f"file://{remote_dir}"]
    if os.geteuid() == 0:
        for path in [local, remote_dir, *local.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
    (ckpt.path / unreadable).chmod(0)
    command = [sys.executable, "-m", "uploader", *args]
    done = subprocess.run(as_nobody(command), env=isolated_aws_env(ADMIN), capture_output=True, text=True, timeout=60)
    (ckpt.path / unreadable).chmod(0o755)
    return done, ckpt, remote_dir


@pytest.mark.parametrize("unreadable", ["state.pt", MANIFEST_NAME])
def test_a_checkpoint_this_user_may_not_read_is_exit_3_and_never_set_aside(unreadable: str) -> None:
    """Review B, 06: a sidecar running as another user than the job set the good checkpoint aside as
    corrupt; every later start then resumed the one before."""
    with tempfile.TemporaryDirectory() as top:
        done, ckpt, remote_dir = _sync_unreadable(Path(top), unreadable)

        assert done.returncode == 3, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert f"cannot read {ckpt.path / unreadable}" in line and "run the uploader as a user that may read" in line
        assert list_committed(ckpt.path.parent) == [ckpt] and list_set_aside(ckpt.path.parent) == []
        assert list(remote_dir.iterdir()) == []


def test_a_checkpoint_folder_this_user_may_not_enter_is_exit_3() -> None:
    """Review B, 07: it was skipped without a word (exit 0), and a watch that then saw the job finish
    exited 0 as if everything were uploaded."""
    with tempfile.TemporaryDirectory() as top:
        done, ckpt, remote_dir = _sync_unreadable(Path(top), "")

        assert done.returncode == 3, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert f"cannot read {ckpt.path}: Permission denied; run the uploader as a user that may read" in line
        assert list(remote_dir.iterdir()) == []


@pytest.mark.parametrize("damage", sorted(NOT_REPLACED))
def test_sync_exits_6_with_one_line_on_a_remote_step_it_must_not_replace_and_changes_nothing(
    tmp_path: Path, damage: str
) -> None:
    """Review B, 01 and 05: sync set the good local step aside (a folder in the remote), or replaced a newer
    build's checkpoint with this build's (as `pull` refuses it: exit 6); both exited 0."""
    remote_dir, local = tmp_path / "remote", tmp_path / "local"
    make_checkpoint(local, 10)
    newest = make_checkpoint(local, 20)
    make, says = NOT_REPLACED[damage]
    make(remote_dir, newest)
    before = (checkpoints_of(local), files_of(remote_dir / newest.name))

    result = run_cli(["sync", str(local), f"file://{remote_dir}"], isolated_aws_env(ADMIN))

    assert result.returncode == 6, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("uploader: error: ") and says in last, last
    assert (checkpoints_of(local), files_of(remote_dir / newest.name)) == before


def test_a_folder_where_latest_goes_is_named_in_a_warning_and_the_upload_stands(tmp_path: Path) -> None:
    """Review B, 03: it was exit 1 after the upload, and a sidecar's crash loop; pulls never need latest."""
    remote_dir, local = tmp_path / "remote", tmp_path / "local"
    (remote_dir / "latest").mkdir(parents=True)
    ckpt = make_checkpoint(local, 20)

    result = run_cli(["sync", str(local), f"file://{remote_dir}"], isolated_aws_env(ADMIN))

    assert result.returncode == 0, result.stderr
    assert "latest on file://" in result.stderr and "is not updated" in result.stderr
    assert data_files_of(remote_dir / ckpt.name) == data_files_of(ckpt.path)


def test_sync_to_a_folder_this_user_may_not_write_exits_3(tmp_path: Path, immutable_folder: Path) -> None:
    make_checkpoint(tmp_path / "local", 1)
    result = run_cli(["sync", str(tmp_path / "local"), f"file://{immutable_folder}"], isolated_aws_env(ADMIN))

    assert result.returncode == 3, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("uploader: error: cannot ") and "Operation not permitted" in last and "uid" in last
    assert list(immutable_folder.iterdir()) == []


def test_local_and_remote_paths_through_a_file_are_refused_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a folder")
    pull = run_cli(["pull", f"file://{tmp_path / 'remote'}", str(tmp_path / "afile" / "sub")], isolated_aws_env(ADMIN))
    ls = run_cli(["ls", f"file://{tmp_path / 'afile'}"], isolated_aws_env(ADMIN))

    assert pull.returncode == 2, pull.stderr
    [line] = pull.stderr.strip().splitlines()
    assert line.startswith(f"uploader: error: Invalid value for LOCAL: {tmp_path / 'afile' / 'sub'} cannot be "
                           f"created: {tmp_path / 'afile'} is a file (see '") and line.endswith("uploader pull --help')")
    assert ls.returncode == 4 and ls.stdout == "", ls.stderr
    assert ls.stderr.strip() == f"uploader: error: {tmp_path / 'afile'} is a file, not a folder: fix the file:// URL"
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_a_file_remote_on_a_volume_not_mounted_is_a_missing_bucket_but_a_new_run_is_empty(tmp_path: Path) -> None:
    """The folder above a file:// remote is its bucket: missing, a volume was not mounted, and a pull that
    found nothing there would start the run again. The remote folder alone missing is a run's first start."""
    unmounted = f"file://{tmp_path / 'not-mounted' / 'run'}"
    ls, pull = (run_cli(args, isolated_aws_env(ADMIN)) for args in (["ls", unmounted],
                                                                     ["pull", unmounted, str(tmp_path / "local")]))
    new = run_cli(["ls", f"file://{tmp_path / 'run'}"], isolated_aws_env(ADMIN))

    for result in (ls, pull):
        assert result.returncode == 4, result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            f"uploader: error: {tmp_path / 'not-mounted'} does not exist: mount the shared volume or fix the file:// URL")
    assert (new.returncode, new.stdout) == (0, ""), new.stderr
    assert not (tmp_path / "not-mounted").exists() and not (tmp_path / "local").exists()


def test_sync_of_a_folder_without_checkpoints_says_so(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = run_cli(["sync", str(tmp_path / "empty"), f"file://{tmp_path / 'remote'}"], isolated_aws_env(ADMIN))

    assert result.returncode == 0, result.stderr
    assert "holds no committed checkpoint" in result.stderr


def test_the_package_never_imports_torch() -> None:
    code = "import uploader.cli, uploader.worker, uploader.sync; import sys; assert 'torch' not in sys.modules"

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    assert result.returncode == 0, result.stderr
