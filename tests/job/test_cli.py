"""The `job` command as users run it: flags, env vars, errors, logs, inspect."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

import click
import pytest

from job.cli import cli as job_cli
from job.cli import main
from job.entry import STOP_SIGNALS, stopped_before_start
from tests.support.checkpoints import checkpoints_of
from tests.support.disk import limit_file_size
from tests.support.jobs import events, inspect, job_cmd, job_env, run_job
from tests.support.users import as_nobody
from uploader.cli import main as uploader_main
from uploader import local

TINY_ARGS = ["--max-duration", "30ba", "--batch-size", "64", "--eval-interval", "10ba", "--seed", "3"]


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--max-duration", "10xx"], "--max-duration"),
        (["train", "--max-duration", "0.5dur"], "dur"),
        # Counts past 2**62 trained, then every later start refused the run's own checkpoints as damaged (review).
        (["train", "--max-duration", "4611686018427387904tok"], "--max-duration 4611686018427387904tok is beyond"),
        (["train", "--max-duration", "100000000000000000ba"], "is 100000000000000000 steps of 64 samples, beyond"),
        (["train", "--max-duration", "10000000000000000ep"], "is 480000000000000000 steps of 64 samples, beyond"),
        (["train", "--device", "gpu"], "--device"),
        (["train", "--batch-size", "0"], "--batch-size"),
        (["train", "--grad-accum", "3"], "--grad-accum"),
        (["train", "--save-interval", "5q"], "--save-interval"),
        (["train", "--keep", "0"], "--keep"),
        (["train", "--save-folder", ""], "'--save-folder' (env var: 'JOB_SAVE_FOLDER'): is empty; give a folder"),
        (["train", "--num-workers", "99999999999999999999"], "99999999999999999999 is not in the range 0<=x<=256"),
        (["train", "--precision", "amp_bf16", "--device", "cpu"], "--precision"),
        (["train", "--model", "no_such_pkg.mod:fn"], "--model"),
        (["train", "--data", "spirals-but-typo"], "--data"),
        (["train", "--bogus"], "--bogus"),
        (["train", "--remote", "s3://"], "--remote: not an S3 remote"),
        (["train", "--remote", "file://relative/path"], "three slashes"),
        (["inspect", "/nonexistent/checkpoint"], "/nonexistent/checkpoint"),
        (["inspect", ""], "PATH is empty"),  # both were "." (the working folder), exit 6 (review)
        (["train", "--resume", ""], "--resume is empty"),
        (["train", "--seed", "-1"], "--seed"),
        (["train", "--seed", "4294967296"], "--seed"),
        (["train", "--lr", "inf"], "--lr"),
        (["train", "--spot-poll-interval", "nan"], "'nan' is not a number of seconds a wait can take"),
        (["train", "--grace-period", "inf"], "--grace-period"),
        (["train", "--sharded"], "torchrun"),
        (["train", "--spot-notice", "aws", "--spot-endpoint", "notaurl"], "--spot-endpoint"),
        (["train", "--save-interval", "1.5dur"], "--save-interval"),
        (["train", "--max-duration", "30ba", "--save-interval", "0.01dur"], "--save-interval 0.01dur of --max-"),
        (["train", "--max-duration", "30ba", "--eval-interval", "0.001dur"], "--eval-interval 0.001dur of --max-"),
        (["train", "--max-duration", "1000tok", "--eval-interval", "0.5dur"], "--eval-interval 0.5dur of --max-"),
    ],
)
def test_bad_input_gives_one_clear_line_and_nonzero_exit(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, *argv)
    assert code not in (0, None)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("job: error:") and needle in lines[0]
    assert not (tmp_path / "checkpoints").exists()


SETTINGS_REFUSED = "job: error: the S3 client refuses its settings ("


@pytest.mark.parametrize(
    "argv, env, starts",
    [
        (["inspect", "s3://"], {}, "job: error: not an S3 remote: 's3://'"),
        (["inspect", "file://relative"], {}, "job: error: not a file remote: 'file://relative'"),
        (["report", "gs://bucket/run"], {}, "job: error: unsupported remote 'gs://bucket/run'"),
        (["inspect", "s3://bucket/run", "--endpoint-url", "http://127.0.0.1:99999"], {},
         "job: error: endpoint_url 'http://127.0.0.1:99999' is not an http(s) URL with a host and a port"),
        (["train", "--remote", "s3://bucket/run", "--endpoint-url", "http://[::1"], {},
         "job: error: endpoint_url 'http://[::1' is not an http(s) URL"),
        (["train", "--remote", "s3://Not_A_Bucket!/run"], {},
         "job: error: --remote: 'Not_A_Bucket!' in 's3://Not_A_Bucket!/run' is not a bucket name"),
        (["train", "--spot-notice", "aws", "--spot-endpoint", "http://127.0.0.1:99999"], {},
         "job: error: --spot-endpoint 'http://127.0.0.1:99999' is not an http(s) URL with a host and a port"),
        (["train", "--remote", "s3://bucket/run"], {"AWS_ENDPOINT_URL": "admin:SECRET-PASSWORD@127.0.0.1:9000"},
         SETTINGS_REFUSED + "ValueError: Invalid endpoint: ***@127.0.0.1:9000)"),
        (["inspect", "s3://bucket/run"], {"AWS_ENDPOINT_URL": "http://127.0.0.1:99999"},
         SETTINGS_REFUSED + "EndpointResolutionError: Custom endpoint `http://127.0.0.1:99999` was not a valid URI)"),
        (["train", "--remote", "s3://bucket/run"], {"AWS_DEFAULT_REGION": "us east!"},
         SETTINGS_REFUSED + "InvalidRegionError: Provided region_name 'us east!' doesn't match a supported format.)"),
        (["train"], {"WORLD_SIZE": "abc"}, "job: error: WORLD_SIZE='abc' is not a whole number: torchrun sets it"),
        (["train"], {"WORLD_SIZE": "2"}, "job: error: WORLD_SIZE is 2 but MASTER_ADDR and MASTER_PORT do not name"),
    ],
    ids=["inspect-s3", "inspect-relative-file", "report-scheme", "endpoint-port", "endpoint-ipv6", "bucket-name",
         "spot-endpoint-port", "env-endpoint-with-a-password", "env-endpoint-port", "env-region", "env-world-size",
         "env-no-rendezvous"],
)
def test_bad_settings_wherever_they_come_from_are_exit_2_in_one_line(capsys, tmp_path, monkeypatch, argv, env, starts):
    """Each was exit 1 with a traceback ("a bug"), the password in AWS_ENDPOINT_URL printed in clear. The client's
    own settings come from the environment too, past the flags' checks: its refusal is bad configuration."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, out, err = run_main(capsys, *argv, *(["--max-duration", "1ba"] if argv[0] == "train" else []))
    assert code == 2 and out == "", err
    [line] = [line for line in err.splitlines() if line.strip()]
    assert line.startswith(starts)
    assert "SECRET-PASSWORD" not in err and not (tmp_path / "checkpoints").exists()


def test_an_empty_save_folder_variable_is_refused_not_the_default(capsys, tmp_path, monkeypatch):
    """click drops an empty variable: JOB_SAVE_FOLDER= trained into ./checkpoints, in a container its writable
    layer. The flag given on the command line still wins over it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JOB_SAVE_FOLDER", "")
    code, _, err = run_main(capsys, "train", "--max-duration", "1ba")
    assert code == 2
    assert err.strip() == ("job: error: JOB_SAVE_FOLDER is set but empty: give it a folder, or unset it for the "
                           "default ./checkpoints")
    assert not (tmp_path / "checkpoints").exists()
    code, _, err = run_main(capsys, "train", "--max-duration", "1ba", "--save-folder", str(tmp_path / "given"))
    assert code == 0, err
    assert (tmp_path / "given").is_dir() and not (tmp_path / "checkpoints").exists()


def test_a_seed_that_overflows_on_the_last_rank_is_refused_before_joining(capsys, tmp_path, monkeypatch):
    """Rank r seeds with seed + r: under torchrun the top seed is valid for rank 0 and not for rank 1."""
    monkeypatch.chdir(tmp_path)
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    code, _, err = run_main(capsys, "train", "--seed", "4294967295")
    assert code == 2
    assert err.strip() == ("job: error: --seed 4294967295: rank r seeds with seed + r, and rank 1 would pass "
                           "4294967295; use a seed below 4294967295")


@pytest.mark.parametrize(
    "max_duration, save_interval, eval_interval, expected_save, expected_eval",
    [
        ("12ep", "0.25dur", "0.5dur", "3ep", "6ep"),
        ("20ep", "0.25dur", "0.5dur", "5ep", "10ep"),  # a resume with another --max-duration: recomputed
        ("300ba", "0.1dur", "0.25dur", "30ba", "75ba"),
        ("12ep", "0.1dur", "2ep", "0.1dur", "2ep"),  # 1.2ep: left for the run, once the epoch length is known
    ],
)
def test_dur_intervals_are_fractions_of_this_starts_max_duration(
        capsys, tmp_path, monkeypatch, max_duration, save_interval, eval_interval, expected_save, expected_eval):
    import job.app
    from job.app import Outcome

    seen = {}

    def fake_train(cfg, ckpt, remote, stop, spot):
        seen.update(eval=str(cfg.eval_interval), save=str(ckpt.interval))
        return Outcome(None, preempted=False)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job.app, "train", fake_train)
    code, _, err = run_main(capsys, "train", "--max-duration", max_duration, "--save-interval", save_interval,
                            "--eval-interval", eval_interval, "--device", "cpu")
    assert code == 0, err
    assert seen == {"save": expected_save, "eval": expected_eval}


def test_every_option_has_an_env_var_and_shows_its_default(capsys):
    code, out, _ = run_main(capsys, "train", "--help")
    assert code == 0
    for env in ("JOB_MAX_DURATION", "JOB_SAVE_FOLDER", "JOB_SAVE_INTERVAL", "JOB_RESUME", "JOB_LOG_FORMAT"):
        assert env in out
    assert "JOB_SAVE_INTERVAL; default: 5m]" in " ".join(out.split())


def test_env_var_sets_an_option(capsys, monkeypatch):
    monkeypatch.setenv("JOB_MAX_DURATION", "12parsecs")
    code, _, err = run_main(capsys, "train")
    assert code == 2 and "12parsecs" in err


def test_train_logs_json_events_and_inspect_reports_the_checkpoint(tmp_path):
    folder = tmp_path / "ck"
    done = run_job("train", *TINY_ARGS, "--save-folder", str(folder), "--save-interval", "10ba", "--sync-save")
    assert done.returncode == 0, done.stderr
    names = [e.get("event") for e in events(done.stderr)]
    assert names.count("checkpoint") == 3 and names[-1] == "finished" and "progress" in names and "eval" in names
    assert "resumed" not in names
    info = inspect(folder)
    assert (info["step"], info["epoch"], info["samples"]) == (30, 0, 30 * 64)
    assert len(info["model_sha256"]) == 64
    assert local.read_finished(folder) == 30

    again = run_job("train", *TINY_ARGS, "--save-folder", str(folder), "--max-duration", "40ba")
    assert again.returncode == 0, again.stderr
    resumed = [e for e in events(again.stderr) if e.get("event") == "resumed"]
    assert resumed == [resumed[0]] and resumed[0]["step"] == 30 and str(folder) in resumed[0]["source"]


def test_hostile_checkpoint_is_refused_by_the_cli(tmp_path):
    from tests.job.test_checkpoint import write_hostile_checkpoint

    sentinel = tmp_path / "pwned"
    path = write_hostile_checkpoint(tmp_path / "ck", sentinel)
    for argv in (["train", *TINY_ARGS, "--resume", str(path), "--save-folder", str(tmp_path / "out")],
                 ["inspect", str(path)]):
        done = run_job(*argv)
        assert done.returncode == 6, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert "pickled code" in last and "Unsupported global: GLOBAL " in last  # what the file wanted
        assert "weights_only" not in last and "\x1b" not in last  # not torch's advice to load it anyway
    assert not sentinel.exists()


def test_full_disk_fails_clearly_and_keeps_the_last_good_checkpoint(tmp_path):
    folder = tmp_path / "ck"
    assert run_job("train", *TINY_ARGS, "--save-folder", str(folder)).returncode == 0
    before = inspect(folder)
    done = run_job("train", *TINY_ARGS, "--max-duration", "60ba", "--save-folder", str(folder),
                   "--save-interval", "10ba", preexec_fn=limit_file_size(16 * 1024))
    assert done.returncode == 7, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("job: error: cannot write a checkpoint") and "previous checkpoint is untouched" in last
    assert inspect(folder) == before
    assert not [p for p in folder.iterdir() if p.name.startswith(local.STAGING_PREFIX)]


def test_a_run_that_diverges_writes_no_checkpoint_of_it_and_keeps_the_good_ones(tmp_path):
    """A run whose parameters turned NaN went on checkpointing them, and after --keep saves retention had
    pushed every good checkpoint out, in the folder and in the remote: nothing left to resume from. Now
    the checkpoint of a state with NaN or Inf is not written: exit 8, one line naming the tensor, the step
    and the newest checkpoint kept, the folder and the remote as they were. The job stops after the step in
    which the writer found it, not once the next checkpoint is due (step 200): it trains for nothing till then."""
    folder, remote = tmp_path / "ck", tmp_path / "remote"
    args = (*TINY_ARGS, "--model", "tests.support.slow_model:build", "--save-folder", str(folder),
            "--remote", f"file://{remote}", "--save-interval", "10ba", "--keep", "2")
    assert run_job("train", *args).returncode == 0
    before, uploaded = checkpoints_of(folder), checkpoints_of(remote)
    assert {name.split("/")[0] for name in uploaded} >= {"step-000000000030"}
    done = run_job("train", *args, "--max-duration", "400ba", "--save-interval", "100ba", "--lr", "1e30",
                   "--log-interval", "1")
    assert done.returncode == 8, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"job: error: training diverged at step 100: model\.\S+ holds NaN or Inf; that checkpoint "
                        rf"is not written, and the ones before it are kept \(newest in {re.escape(str(folder))}: step "
                        r"30\); resume the newest good one with a change .*", last), last
    assert checkpoints_of(folder) == before and checkpoints_of(remote) == uploaded
    assert not [p for p in folder.iterdir() if p.name.startswith(local.STAGING_PREFIX)]
    assert json.loads((folder / local.FINISHED_NAME).read_text()) == {"step": 30, "reason": "failed"}
    # The writer's check and its failure take milliseconds; 100 slow steps are 2 s.
    assert 100 <= max(e["step"] for e in events(done.stderr) if e.get("event") == "progress") < 200


def test_unwritable_save_folder_fails_at_start_up(tmp_path):
    """A save folder that cannot be written fails before any training (not one save interval later),
    with exit 7 and one line. A regular file in its path stands for a permission problem: root, which
    runs these tests in CI, may write anywhere."""
    (tmp_path / "a-file").write_text("")
    done = run_job("train", *TINY_ARGS, "--save-folder", str(tmp_path / "a-file" / "ck"))
    assert done.returncode == 7, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"job: error: cannot write checkpoints to {tmp_path / 'a-file' / 'ck'}: Not a directory")
    assert not [e for e in events(done.stderr) if e["event"] in ("progress", "checkpoint")]


@pytest.mark.parametrize("folder", ["/proc/spot-trainer-ck", "/sys/kernel/spot-trainer-ck"])
def test_a_save_folder_root_may_not_write_either_fails_at_start_up(folder):
    """os.access says yes to root everywhere, and /proc and /sys refuse root too: the run trained to its end,
    then failed its first save (exit 7, review). Where the tests run as another user, os.access says no."""
    done = run_job("train", *TINY_ARGS, "--save-folder", folder)
    assert done.returncode == 7, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"job: error: cannot write checkpoints to {folder}: ")
    assert not [e for e in events(done.stderr) if e["event"] in ("progress", "checkpoint")]


def test_a_save_folder_inside_one_this_user_may_not_enter_fails_at_start_up_in_one_line():
    """Looking for the nearest folder that exists met EACCES: a traceback (exit 1, "a bug"). Root enters any
    folder: the job runs as nobody then, in /tmp (pytest's tmp_path lies in a folder only its owner may enter)."""
    with tempfile.TemporaryDirectory() as top:
        closed, as_root = Path(top) / "closed", os.geteuid() == 0
        closed.mkdir(mode=0o700 if as_root else 0)
        Path(top).chmod(0o755)
        command = job_cmd("train", *TINY_ARGS, "--save-folder", str(closed / "ck"))
        done = subprocess.run(as_nobody(command), env=job_env(), cwd=top, capture_output=True, text=True, timeout=120)
        closed.chmod(0o700)
    assert done.returncode == 7, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"job: error: cannot write checkpoints to {closed / 'ck'}: Permission denied; make it writable")
    assert "Traceback" not in done.stderr


def test_an_older_runs_marker_that_cannot_be_cleared_is_a_write_error(tmp_path):
    folder = tmp_path / "ck"
    assert run_job("train", *TINY_ARGS, "--save-folder", str(folder)).returncode == 0
    before = inspect(folder)
    (folder / local.FINISHED_NAME).unlink()
    (folder / local.FINISHED_NAME).mkdir()  # unlink() fails on it, as it does in a folder not ours
    (folder / local.FINISHED_NAME / "x").write_text("")
    done = run_job("train", *TINY_ARGS, "--max-duration", "60ba", "--save-folder", str(folder))
    assert done.returncode == 7, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"job: error: cannot write checkpoints to {folder}")
    assert "Traceback" not in done.stderr
    assert inspect(folder) == before


def test_a_checkpoint_from_a_newer_build_is_refused_not_trained_over(tmp_path):
    """Rolling back to an older image must not resume from the previous checkpoint and write over
    the newer one: exit 6, one line asking for an upgrade, every checkpoint as it was."""
    folder = tmp_path / "ck"
    assert run_job("train", *TINY_ARGS, "--save-folder", str(folder), "--save-interval", "10ba").returncode == 0
    newest = local.list_committed(folder)[-1].path / local.MANIFEST_NAME
    newest.write_text(json.dumps({**json.loads(newest.read_text()), "format_version": 99}))
    before = checkpoints_of(folder)

    done = run_job("train", *TINY_ARGS, "--max-duration", "60ba", "--save-folder", str(folder))
    assert done.returncode == 6, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("job: error: checkpoint ") and "format_version 99" in last and "upgrade spot-trainer" in last
    assert checkpoints_of(folder) == before
    # The refused start is a life of the run all the same, ended with the exit code the CLI gave it.
    ends = [json.loads(p.read_text())["end"] for p in sorted((folder / "runlog" / "ledger").glob("life-*.json"))]
    assert [(e["how"], e["exit_code"]) for e in ends] == [("finished", 0), ("failed", 6)]


def test_a_checkpoint_of_another_model_says_what_differs_and_what_to_do(tmp_path):
    folder = tmp_path / "ck"
    assert run_job("train", *TINY_ARGS, "--save-folder", str(folder)).returncode == 0
    before = inspect(folder)

    done = run_job("train", *TINY_ARGS, "--max-duration", "60ba", "--model", "mlp-large", "--save-folder", str(folder))
    assert done.returncode == 6, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "does not fit this model/optimizer" in last and "size mismatch for" in last  # not just torch's header
    assert "resume it with the --model it was written with" in last
    assert inspect(folder) == before


def test_default_run_learns(tmp_path):
    """`job train` with no arguments: the built-in model visibly learns (eval accuracy rises)."""
    done = run_job("train", cwd=tmp_path, env=job_env())
    assert done.returncode == 0, done.stderr
    accuracy = [e["metrics"]["eval"]["accuracy"] for e in events(done.stderr) if e.get("event") == "eval"]
    assert len(accuracy) >= 10
    assert accuracy[-1] > 0.95 and accuracy[-1] > accuracy[0] + 0.1
    assert (tmp_path / "checkpoints").is_dir()
    assert json.loads((tmp_path / "checkpoints" / "FINISHED").read_text())["step"] == 12 * 48



@pytest.mark.parametrize("command", [["inspect", "/nonexistent/checkpoint"], ["report", "/nonexistent/run"]])
def test_commands_that_train_nothing_get_pythons_own_signal_handling_back(capsys, command):
    """job.entry ends the process with exit 75 on a stop signal until training can answer it; that code means
    "stopped, to be resumed", which `job inspect` or `job report` never are: Ctrl-C is a KeyboardInterrupt there."""
    previous = {sig: signal.signal(sig, stopped_before_start) for sig in STOP_SIGNALS}
    try:
        run_main(capsys, *command)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_options_that_need_another_one_say_so_when_given_without_it(tmp_path):
    """--endpoint-url without --remote (a half-edited manifest) did nothing and said nothing; defaults stay quiet."""
    done = run_job("train", *TINY_ARGS, "--save-folder", str(tmp_path / "ck"), "--log-format", "json",
                   "--endpoint-url", "http://127.0.0.1:9", "--upload", "off",
                   env=job_env(JOB_SPOT_POLL_INTERVAL="3"))
    assert done.returncode == 0, done.stderr
    assert [e["message"] for e in events(done.stderr) if e.get("level") == "warning"] == [
        "--upload has no effect without --remote (given as a flag or JOB_UPLOAD); ignoring it",
        "--endpoint-url has no effect without --remote (given as a flag or JOB_ENDPOINT_URL); ignoring it",
        "--spot-poll-interval has no effect with --spot-notice off (given as a flag or JOB_SPOT_POLL_INTERVAL); "
        "ignoring it",
    ]
    quiet = run_job("train", *TINY_ARGS, "--save-folder", str(tmp_path / "quiet"), "--log-format", "json")
    assert quiet.returncode == 0 and not [e for e in events(quiet.stderr) if e.get("level") == "warning"]


def _help_records(group: click.Group) -> list[tuple[str, str]]:
    """(command, option help text) for every option of ``group`` and of its commands, as --help shows them."""
    root = click.Context(group, info_name=group.name)
    records = [(group.name or "", p.get_help_record(root)) for p in group.params if isinstance(p, click.Option)]
    for name, command in group.commands.items():
        ctx = click.Context(command, parent=root, info_name=name)
        records += [(name, p.get_help_record(ctx)) for p in command.params if isinstance(p, click.Option)]
    return [(where, record[1]) for where, record in records if record is not None and record[0] != "--version"]


@pytest.mark.parametrize("group", [job_cli, uploader_main], ids=["job", "uploader"])
def test_every_option_shows_its_environment_variable_and_its_default_in_help(group):
    """click's own convention, this project's rule: options whose default is none said nothing at all."""
    records = _help_records(group)
    assert len(records) > 10
    missing = [(where, text) for where, text in records if "env var:" not in text or "default:" not in text]
    assert missing == []
