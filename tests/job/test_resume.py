"""Bit-exact resume: training interrupted and resumed equals training straight through."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from job.exceptions import CheckpointLoadError, ConfigError
from job.storage import RemoteConfig
from tests.support.checkpoints import checkpoints_of, corrupt_file
from tests.support.elastic import TORCHRUN
from tests.support.jobs import JobProcess, assert_states_equal, ckpt_config, job_env, train_state
from uploader import local
from uploader.config import UploadConfig
from uploader.remote import open_remote
from uploader.sync import push_all

BATCHES_PER_EPOCH = 48  # spirals: 3072 samples / 64


@pytest.fixture
def straight(tiny_config, tmp_path):
    return train_state(tiny_config(), ckpt_config(tmp_path / "straight"))


def _train_with_stops(cfg, folder, stops):
    for stop in stops:
        stopped = train_state(cfg, ckpt_config(folder), stop_at=stop)
        assert stopped.timer.batch.value == stop
    return train_state(cfg, ckpt_config(folder))


@pytest.mark.parametrize(
    "stops",
    [[1], [25], [30], [BATCHES_PER_EPOCH], [BATCHES_PER_EPOCH + 1], [9, 33, 50, 69]],
    ids=["after-first-step", "right-after-eval", "mid-epoch", "epoch-boundary", "second-epoch", "four-stops"],
)
def test_resumed_run_equals_uninterrupted_run(tiny_config, tmp_path, straight, stops):
    resumed = _train_with_stops(tiny_config(), tmp_path / "resumed", stops)
    assert resumed.timer.batch.value == 70
    assert_states_equal(straight, resumed)


@pytest.mark.parametrize("changed", [{"max_duration": "160ba"}, {"lr": 6e-3}], ids=["longer-run", "higher-lr"])
def test_a_resume_with_other_schedule_flags_follows_the_new_schedule(tiny_config, tmp_path, caplog, changed):
    """The flags decide the learning-rate schedule, the checkpoint only the step. Restored whole, a
    70-batch cosine extended to 160 batches was back at its peak lr by step 140; a new --lr was ignored."""
    folder = tmp_path / "changed"
    train_state(tiny_config(), ckpt_config(folder), stop_at=30)
    with caplog.at_level(logging.WARNING, logger="job.build"):
        resumed = train_state(tiny_config(**changed), ckpt_config(folder), stop_at=60)
    fresh = train_state(tiny_config(**changed), ckpt_config(tmp_path / "fresh"), stop_at=60)

    [scheduler], [expected] = resumed.schedulers, fresh.schedulers
    assert (scheduler.T_max, scheduler.base_lrs) == (expected.T_max, expected.base_lrs)
    assert resumed.optimizers[0].param_groups[0]["lr"] == pytest.approx(fresh.optimizers[0].param_groups[0]["lr"],
                                                                        rel=1e-9)
    assert "from step 30 on the new one is followed" in caplog.text


def test_resumed_run_with_dataloader_workers_equals_uninterrupted_run(tiny_config, tmp_path):
    cfg = tiny_config(num_workers=2)
    straight = train_state(cfg, ckpt_config(tmp_path / "straight"))
    assert_states_equal(straight, _train_with_stops(cfg, tmp_path / "resumed", [30]))


def test_interruption_changes_nothing_even_with_periodic_checkpoints(tiny_config, tmp_path, straight):
    # Saving every few batches must not perturb the run (no RNG draws, no data-order change).
    folder = tmp_path / "periodic"
    cfg = tiny_config()
    train_state(cfg, ckpt_config(folder, interval="7ba"), stop_at=40)
    resumed = train_state(cfg, ckpt_config(folder, interval="7ba"))
    assert_states_equal(straight, resumed)


def test_finished_run_restarted_does_no_more_work(tiny_config, tmp_path):
    folder = tmp_path / "done"
    first = train_state(tiny_config(), ckpt_config(folder))
    again = train_state(tiny_config(), ckpt_config(folder))
    assert again.timer.batch.value == first.timer.batch.value == 70
    assert_states_equal(first, again)


def test_resume_never_starts_from_scratch_beside_checkpoints_set_aside(tiny_config, tmp_path, straight):
    """Checkpoints that failed verification were set aside: they are never chosen, so a new run may start."""
    folder = tmp_path / "never"
    train_state(tiny_config(), ckpt_config(folder), stop_at=20)
    for ckpt in local.list_committed(folder):
        local.set_aside(ckpt, "damaged, in this test")
    fresh = train_state(tiny_config(), ckpt_config(folder, resume="never"))
    assert_states_equal(straight, fresh)
    assert [c.step for c in local.list_committed(folder)] == [70] and len(local.list_set_aside(folder)) == 1


def test_resume_never_refuses_a_folder_that_holds_another_run(tiny_config, tmp_path):
    """A new run among an older run's checkpoints: they would stay newest and be resumed next time."""
    folder = tmp_path / "used"
    train_state(tiny_config(), ckpt_config(folder), stop_at=20)
    before = checkpoints_of(folder)
    with pytest.raises(ConfigError, match="already holds checkpoints of a run .*its own --save-folder"):
        train_state(tiny_config(), ckpt_config(folder, resume="never"))
    assert checkpoints_of(folder) == before


def _resume_views(folder, view: str, out) -> tuple[list[dict], str]:
    """tests.support.resume_views on two ranks: what each rank resumed (or the error it raised), and stderr."""
    out.mkdir()
    proc = JobProcess([*TORCHRUN, "--nproc-per-node", "2", "-m", "tests.support.resume_views", str(folder), view,
                       str(out)], env=job_env())
    code = proc.wait(240)
    assert code == 0, proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))], proc.stderr


@pytest.mark.slow
def test_ranks_that_do_not_see_rank_0s_file_are_sent_the_state(tiny_config, tmp_path):
    """On one node every rank maps the state.pt rank 0 chose (job.resume); a rank that sees another file
    there, or none (another machine's disk), gets the state from rank 0 instead, and resumes the same."""
    folder = tmp_path / "ckpts"
    train_state(tiny_config(max_duration="4ba"), ckpt_config(folder, interval="2ba", async_save=False))

    mapped, quiet = _resume_views(folder, "same", tmp_path / "same")
    sent, warned = _resume_views(folder, "other", tmp_path / "other")
    assert [r["rank"] for r in mapped] == [r["rank"] for r in sent] == [0, 1]
    assert {r["step"] for r in mapped + sent} == {4}
    assert len({r["model"] for r in mapped + sent}) == 1
    assert "rank 0 sends it" in warned and "rank 0 sends it" not in quiet


@pytest.mark.slow
def test_a_rank_that_cannot_read_the_mapped_file_refuses_it_for_every_rank(tiny_config, tmp_path):
    """Rank 1 alone fails to read the state.pt both ranks map: neither trains on alone, neither waits for the
    other (the read is inside resume's agreement on errors), both raise, and the checkpoints stay."""
    folder = tmp_path / "ckpts"
    train_state(tiny_config(max_duration="4ba"), ckpt_config(folder, interval="2ba", async_save=False))
    before = checkpoints_of(folder)

    ranks, _ = _resume_views(folder, "unreadable", tmp_path / "unreadable")

    assert [r["rank"] for r in ranks] == [0, 1] and all(r["step"] is None for r in ranks)
    assert "rank 1 cannot read" in ranks[1]["error"]
    assert "rank 1 cannot read" in ranks[0]["error"] and "(seen by another rank)" in ranks[0]["error"]
    assert checkpoints_of(folder) == before


def test_a_corrupt_newer_remote_checkpoint_does_not_pull_an_older_one_than_the_local(tiny_config, tmp_path):
    """The bucket's newest fails verification: the ones before it are only worth a download when newer than
    the good local checkpoint. Once the pull walked down to the oldest, downloading one the job then did not
    use, onto a disk that holds --keep checkpoints already (a disk too full for it was exit 7)."""
    folder, bucket = tmp_path / "ckpts", tmp_path / "bucket"
    remote = RemoteConfig(url=f"file://{bucket}", mode="inprocess", upload=UploadConfig(keep=4))
    flags = tiny_config(max_duration="8ba"), ckpt_config(folder, interval="2ba", keep=4, async_save=False)
    train_state(*flags)  # the in-process uploader may skip a step a newer save superseded: push them all
    assert push_all(folder, open_remote(f"file://{bucket}", remote.upload), keep=4) == [2, 4, 6, 8]
    for step in (2, 4, 8):  # this disk holds step 6 only; the bucket steps 2, 4 and a corrupt 8
        shutil.rmtree(folder / local.checkpoint_name(step))
    shutil.rmtree(bucket / local.checkpoint_name(6))
    corrupt_file(bucket / local.checkpoint_name(8) / "state.pt")

    resumed = train_state(*flags, remote_cfg=remote)

    assert resumed.timer.batch.value == 8
    assert [c.step for c in local.list_committed(folder)] == [6, 8]  # resumed step 6; neither 2 nor 4 pulled


def test_a_run_started_from_another_folders_checkpoint_saves_it_in_its_own(tiny_config, tmp_path, straight):
    """--resume PATH outside --save-folder counted PATH's step as saved here: started from a finished run's last
    checkpoint, or stopped before its first step, the run ended with no checkpoint in its folder (nor in its
    bucket), while `preempted` and FINISHED named one (review 48)."""
    source = tmp_path / "source"
    train_state(tiny_config(), ckpt_config(source, interval="10ba"), stop_at=30)

    stopped = tmp_path / "stopped"
    train_state(tiny_config(), ckpt_config(stopped, resume=str(source / local.checkpoint_name(30))), stop_at=30)
    assert [c.step for c in local.list_committed(stopped)] == [30] and local.read_finished(stopped) == 30
    assert_states_equal(straight, train_state(tiny_config(), ckpt_config(stopped)))  # and on from there

    finished = tmp_path / "finished"
    last = tmp_path / "straight" / local.checkpoint_name(70)
    again = train_state(tiny_config(), ckpt_config(finished, resume=str(last)))
    assert [c.step for c in local.list_committed(finished)] == [70]
    assert_states_equal(straight, again)


def test_a_restart_with_the_same_resume_path_goes_on_from_the_runs_own_newest(tiny_config, tmp_path, straight, caplog):
    """Kubernetes restarts a pod with the same JOB_RESUME: every restart went back to PATH, and the steps trained
    since were trained again (review 48). PATH seeds the run; its own checkpoints, here or in the bucket, win."""
    source = tmp_path / "source"
    train_state(tiny_config(), ckpt_config(source, interval="10ba"), stop_at=30)
    path = str(source / local.checkpoint_name(30))
    folder, bucket = tmp_path / "run", tmp_path / "bucket"
    remote = RemoteConfig(url=f"file://{bucket}", mode="inprocess", upload=UploadConfig())
    train_state(tiny_config(), ckpt_config(folder, interval="10ba", resume=path), stop_at=45, remote_cfg=remote)
    shutil.rmtree(folder)  # a new node: its own checkpoints are in the bucket only
    caplog.clear()  # the first life's records too, where an earlier test's setup_logging left job's loggers at INFO

    with caplog.at_level(logging.INFO):
        resumed = train_state(tiny_config(), ckpt_config(folder, interval="10ba", resume=path), remote_cfg=remote)

    assert [r.fields["step"] for r in caplog.records if getattr(r, "event", None) == "resumed"] == [45]
    assert any(r.getMessage().startswith(f"--resume {path} is not used: file://{bucket} already holds checkpoints "
                                         "of this run") for r in caplog.records)
    assert_states_equal(straight, resumed)



def test_a_seed_inside_the_save_folder_that_is_no_checkpoint_of_it_is_saved_there_too(tiny_config, tmp_path, straight):
    """--resume PATH inside --save-folder, but not one of its checkpoints (a copy under another name), counted as
    saved: the run ended with none of its own (review 49)."""
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copytree(tmp_path / "straight" / local.checkpoint_name(70), folder / "seed")
    again = train_state(tiny_config(), ckpt_config(folder, resume=str(folder / "seed")))
    assert [c.step for c in local.list_committed(folder)] == [70]
    assert_states_equal(straight, again)


def test_a_run_whose_own_checkpoints_fail_is_not_started_over_from_its_seed(tiny_config, tmp_path):
    """Its own newest failed verification: the first start exited 6, and the same command then went back to PATH
    in silence, its steps since lost (review 49). Every start now refuses alike, as with --resume auto."""
    source = tmp_path / "source"
    train_state(tiny_config(), ckpt_config(source, interval="10ba"), stop_at=30)
    folder, path = tmp_path / "run", str(source / local.checkpoint_name(30))
    train_state(tiny_config(), ckpt_config(folder, resume=path), stop_at=40)
    corrupt_file(folder / local.checkpoint_name(40) / "state.pt")
    for _ in range(2):
        with pytest.raises(CheckpointLoadError, match="verif"):  # none verifies; then: set aside as failed
            train_state(tiny_config(), ckpt_config(folder, resume=path))
    assert local.list_committed(folder) == [] and len(local.list_set_aside(folder)) == 1
