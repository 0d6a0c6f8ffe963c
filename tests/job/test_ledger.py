"""What preemption cost: the ledger of lives, `job report`, and curves that survive resumes (issue 21)."""
from __future__ import annotations

import json
import signal
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from job.exceptions import BadRecord
from job.goodput import costs, parse_life, summary
from tests.support.jobs import events, run_job, s3_job_env
from tests.support.s3server import READER, fast_config
from tests.support.tensorboard import read_scalars, steps
from uploader.remote import open_remote
from uploader.runlog import LEDGER_DIR

ARGS = ["--model", "tests.support.slow_model:build", "--max-duration", "120ba", "--eval-interval", "1000ba",
        "--save-interval", "20ba", "--log-interval", "5", "--seed", "3", "--log-format", "json"]


def lives_of(folder: Path) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in (folder / LEDGER_DIR).glob("life-*.json")),
                  key=lambda life: life["started"])


@pytest.mark.slow
def test_a_run_preempted_by_sigterm_then_sigkill_then_finished(spawn, tmp_path, s3_bucket) -> None:
    env, remote, folder = s3_job_env(s3_bucket), s3_bucket.url("run"), tmp_path / "ck"
    train = ("train", *ARGS, "--save-folder", str(folder), "--remote", remote)

    first = spawn(*train, env=env)
    first.wait_event("progress", lambda e: e["step"] >= 30)
    first.signal(signal.SIGTERM)
    assert first.wait() == 75, first.stderr
    stopped_at = first.wait_event("preempted")["step"]

    second = spawn(*train, env=env)
    kept = second.wait_event("uploaded", lambda e: e["step"] > stopped_at)["step"]
    seen = second.wait_event("progress", lambda e: e["step"] >= kept + 10)["step"]  # trained past `kept`
    second.kill()  # SIGKILL: no chance to record its end

    third = run_job(*train, env=env)
    assert third.returncode == 0, third.stderr
    resumed = [e for e in events(third.stderr) if e.get("event") == "resumed"]
    assert [e["step"] for e in resumed] == [kept]

    # The ledger: three lives, with the right starts, ends and lost steps.
    one, two, three = lives_of(folder)
    assert (one["start"]["how"], one["end"]["how"], one["end"]["exit_code"]) == ("fresh", "preempted", 75)
    assert one["last_step"] == stopped_at and one["end"]["checkpoint_step"] == stopped_at
    assert one["end"]["final_save_s"] >= 0
    assert (two["start"]["how"], two["start"]["from_step"], two["end"]) == ("resumed_local", stopped_at, None)
    assert two["previous"] == {"life": one["life"], "last_step": stopped_at, "end": "preempted", "lost_steps": 0}
    assert two["last_step"] >= seen
    assert (three["start"]["how"], three["start"]["from_step"], three["end"]["how"]) == ("resumed_local", kept,
                                                                                          "finished")
    assert three["previous"]["lost_steps"] == two["last_step"] - kept >= 10
    assert three["last_step"] == 120
    for life in (one, two, three):
        assert all(c["stall_s"] is not None and c["write_s"] is not None for c in life["checkpoints"])
    assert any(c.get("upload_s") is not None for c in one["checkpoints"])

    # Uploaded like the checkpoints: the bucket's ledger is the folder's, the killed life's included.
    report = run_job("report", remote, "--format", "json", "--plot", str(tmp_path / "lives.svg"),
                     env=s3_job_env(s3_bucket, READER))  # read-only credentials are enough
    assert report.returncode == 0, report.stderr
    doc = json.loads(report.stdout)
    assert [life["life"] for life in doc["lives"]] == [one["life"], two["life"], three["life"]]
    assert [life["end"] for life in doc["lives"]] == ["preempted", "killed", "finished"]
    assert [life["lost_steps"] for life in doc["lives"]] == [0, two["last_step"] - kept, 0]
    startups = [life["startup"] for life in doc["lives"]]
    assert all(s["build_s"] > 0 and s["first_step_s"] >= s["build_s"] for s in startups)
    assert startups[0]["load_s"] is None and all(s["load_s"] >= 0 for s in startups[1:])
    assert doc["skipped"] == []
    seconds, wall = doc["goodput"]["seconds"], doc["goodput"]["wall_s"]
    assert seconds["lost_progress"] > 0 and seconds["productive"] > 0 and seconds["startup"] > 0
    assert sum(seconds.values()) == pytest.approx(wall, abs=0.01)
    assert 0 < doc["goodput"]["goodput_percent"] < 100
    svg = ET.parse(tmp_path / "lives.svg").getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    assert len([t for t in svg.iter("{http://www.w3.org/2000/svg}text") if (t.text or "").startswith("life-")]) == 3

    text = run_job("report", str(folder), env=env)
    assert text.returncode == 0, text.stderr
    assert "unknown: killed" in text.stdout and "preempted (SIGTERM" in text.stdout and "goodput" in text.stdout

    # One clean curve: every logged step once, in the folder and in the bucket.
    local = read_scalars(folder / "runlog" / "tensorboard")
    assert steps(local, "train/loss") == list(range(5, 121, 5))
    remote = open_remote(s3_bucket.url("run"), fast_config(s3_bucket.endpoint_url))
    for obj in remote.list("runlog/tensorboard/"):
        (tmp_path / "from-bucket" / obj.key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "from-bucket" / obj.key).write_bytes(remote.read_bytes(obj.key) or b"")
    remote.close()
    assert steps(read_scalars(tmp_path / "from-bucket" / "runlog" / "tensorboard"), "train/loss") == \
        list(range(5, 121, 5))


def life_record(**overrides) -> dict:
    record = {"format_version": 1, "kind": "spot-trainer-life", "life": "life-20261204T100000Z-0123abcd",
              "host": "node-a", "world_size": 1, "started": 1_796_000_000.0,
              "start": {"how": "fresh", "from_step": 0},
              "startup": {"built_at": 1_796_000_004.0, "first_step_at": 1_796_000_005.0},
              "checkpoints": [{"step": 100, "at": 1_796_000_055.0, "stall_s": 1.0, "write_s": 2.0, "upload_s": 3.0}],
              "last_step": 150, "last_seen": 1_796_000_080.0,
              "end": {"how": "preempted", "at": 1_796_000_085.0, "exit_code": 75, "reason": "SIGTERM",
                      "final_save_s": 5.0},
              "previous": None}
    record.update(overrides)
    return record


def test_goodput_splits_the_wall_clock_into_its_categories() -> None:
    first = parse_life(json.dumps(life_record()).encode())
    second = parse_life(json.dumps(life_record(
        life="life-20261204T100200Z-0123abce", started=1_796_000_100.0, start={"how": "resumed_remote", "from_step": 100},
        startup={"built_at": 1_796_000_104.0, "restored_at": 1_796_000_106.0, "first_step_at": 1_796_000_107.0},
        checkpoints=[], last_step=200, last_seen=1_796_000_157.0,
        end={"how": "finished", "at": 1_796_000_157.0, "exit_code": 0})).encode())
    one, two = costs([second, first])  # any order in: start order out
    assert one.life is first and one.lost_steps == 50 and one.lost_known
    # Life one: 5 s start-up, 80 s until the stop, 5 s saving at preemption, 1 s blocking save, 75 s training
    # of 150 steps at 74/150 s each: 50 of them lost to the resume from step 100.
    assert one.seconds["startup"] == 5.0 and one.seconds["preemption_save"] == 5.0
    assert one.seconds["checkpoint_stall"] == 1.0
    assert one.seconds["lost_progress"] == pytest.approx(50 * 74 / 150)
    assert one.seconds["productive"] == pytest.approx(74 - 50 * 74 / 150)
    assert one.seconds["scheduling"] == 15.0
    assert (two.seconds["startup"], two.seconds["restore"], two.seconds["productive"]) == (5.0, 2.0, 50.0)
    total = summary([one, two])
    assert total["wall_s"] == 157.0
    assert sum(total["seconds"].values()) == pytest.approx(157.0)
    assert total["goodput_percent"] == pytest.approx(100 * (74 - 50 * 74 / 150 + 50.0) / 157.0)


@pytest.mark.parametrize("raw", [
    b"\x80\x04\x95 not json at all (a pickle)",
    b"[1, 2, 3]",
    json.dumps(life_record(kind="something-else")).encode(),
    json.dumps(life_record(format_version=99)).encode(),
    json.dumps(life_record(life="../../etc/passwd")).encode(),
    json.dumps(life_record(last_step=-5)).encode(),
    json.dumps(life_record(started=float("1e300"))).encode(),
    json.dumps(life_record(started=10 ** 400)).encode(),  # float() overflows: a traceback in job report before
    json.dumps(life_record(checkpoints=[{"step": 1, "at": 1_796_000_001.0, "stall_s": "1; rm -rf /"}])).encode(),
    json.dumps(life_record(end={"how": "exploded", "at": 1_796_000_085.0, "exit_code": 1})).encode(),
    json.dumps(life_record(last_seen=1_700_000_000.0)).encode(),
    # Printed by job report: a lone surrogate cannot be encoded (a traceback), a newline or an escape sequence
    # rewrites the reader's terminal (review)
    json.dumps(life_record(host="\ud800x")).encode(),
    json.dumps(life_record(host="a\nb\x1b[31mred")).encode(),
    json.dumps(life_record(end={"how": "preempted", "at": 1_796_000_085.0, "exit_code": 75,
                                "reason": "SIGTERM\x1b[2J"})).encode(),
    b'{"format_version": 1, "kind": "spot-trainer-life", "life": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
], ids=["pickle", "list", "kind", "format", "life-id", "negative", "time", "huge-int", "stall", "end", "backwards",
        "surrogate", "escapes", "escaped-reason", "deep"])
def test_a_malformed_or_hostile_record_is_refused_with_a_reason(raw: bytes) -> None:
    with pytest.raises(BadRecord):
        parse_life(raw)


def test_the_report_skips_bad_entries_and_still_reports_the_good_ones(tmp_path) -> None:
    ledger = tmp_path / LEDGER_DIR
    ledger.mkdir(parents=True)
    (ledger / "life-20261204T100000Z-0123abcd.json").write_text(json.dumps(life_record()))
    (ledger / "life-20261204T100100Z-0123abce.json").write_bytes(b"\x80\x04 hostile")
    (ledger / "life-20261204T100200Z-0123abcf.json").write_bytes(b"{" * (2 * 1024 * 1024))  # over the size limit
    done = run_job("report", str(tmp_path), "--format", "json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [life["life"] for life in doc["lives"]] == ["life-20261204T100000Z-0123abcd"]
    assert [line.split(":")[0] for line in doc["skipped"]] == [f"{LEDGER_DIR}/life-20261204T100100Z-0123abce.json",
                                                              f"{LEDGER_DIR}/life-20261204T100200Z-0123abcf.json"]
    assert (ledger / "life-20261204T100100Z-0123abce.json").exists()  # read only: nothing deleted


def test_a_report_without_a_ledger_or_with_a_bad_plot_name_is_a_usage_error(tmp_path) -> None:
    done = run_job("report", str(tmp_path))
    assert done.returncode == 2 and "no ledger" in done.stderr
    done = run_job("report", str(tmp_path), "--plot", str(tmp_path / "x.pdf"))
    assert done.returncode == 2 and "--plot" in done.stderr


def test_a_plot_that_cannot_be_written_is_one_line_and_exit_2(tmp_path) -> None:
    """A --plot in a folder that is not there was a traceback (exit 1, "a bug")."""
    ledger = tmp_path / LEDGER_DIR
    ledger.mkdir(parents=True)
    (ledger / "life-20261204T100000Z-0123abcd.json").write_text(json.dumps(life_record()))
    plot = tmp_path / "no-such-folder" / "lives.svg"
    done = run_job("report", str(tmp_path), "--plot", str(plot))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"job: error: --plot {plot}: cannot write it (No such file or "
                                                    "directory): name a file in an existing folder this user may write")


def test_a_long_life_keeps_its_record_small_and_its_stall_whole(tmp_path) -> None:
    from job.ledger import MAX_CHECKPOINTS, Ledger

    ledger = Ledger(tmp_path, world_size=1, started=1_796_000_000.0)
    ledger("built", {})
    ledger("start", {"step": 0})
    for step in range(1, MAX_CHECKPOINTS + 501):
        ledger("checkpoint", {"step": step, "stall": 0.01, "seconds": 0.5})
    ledger("finished", {"step": MAX_CHECKPOINTS + 500})
    record = json.loads(ledger.path.read_text())
    assert len(record["checkpoints"]) == MAX_CHECKPOINTS and record["checkpoints"][0]["step"] == 501
    assert record["checkpoints_dropped"] == {"count": 500, "stall_s": pytest.approx(5.0)}
    life = parse_life(ledger.path.read_bytes())
    assert (life.checkpoints_dropped, life.dropped_stall_s) == (500, pytest.approx(5.0))
    # Stretched to a 1000 s life (in-process the loop took milliseconds), every stall counts, dropped or not.
    record["startup"]["first_step_at"], record["end"]["at"] = 1_796_000_001.0, 1_796_001_001.0
    record["last_seen"] = record["end"]["at"]
    record["checkpoints"] = [{**c, "at": 1_796_000_500.0} for c in record["checkpoints"]]
    (cost,) = costs([parse_life(json.dumps(record).encode())])
    assert cost.seconds["checkpoint_stall"] == pytest.approx(25.0)


def test_a_failing_listener_never_stops_the_event(caplog) -> None:
    import logging

    from job.logs import event, listening

    seen = []

    def broken(name: str, fields: dict) -> None:
        raise KeyError("a bug in a record")

    with listening(broken), listening(lambda name, fields: seen.append(name)):
        event(logging.getLogger("test"), "progress", step=1)
    assert seen == ["progress"]
    assert "a listener of the job's events failed on 'progress'" in caplog.text


def test_a_signal_handler_s_event_inside_a_record_write_does_not_deadlock(tmp_path, monkeypatch) -> None:
    """SIGTERM's handler emits stop_requested in the main thread, between any two bytecodes: also while
    that thread is inside the ledger's lock writing the record (a CI run hung exactly there)."""
    import logging
    import threading

    from job.ledger import Ledger
    from job.logs import event, listening

    log = logging.getLogger("test")
    ledger = Ledger(tmp_path, world_size=1, started=1_796_000_000.0)
    write = ledger._write

    def interrupted() -> None:
        event(log, "stop_requested", signal="SIGTERM", grace_seconds=60)  # the handler, mid-write
        write()

    def emit() -> None:
        with listening(ledger):
            event(log, "built", model="mlp")
            monkeypatch.setattr(ledger, "_write", interrupted)
            event(log, "progress", step=5)

    worker = threading.Thread(target=emit, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the event inside the write deadlocked"
    assert json.loads(ledger.path.read_text())["last_step"] == 5
