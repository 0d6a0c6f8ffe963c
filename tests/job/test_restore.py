"""A checkpoint that verifies byte for byte but holds damaged or hand-made content is refused (exit 6)
before training starts, and nothing of the run's good checkpoints is changed (job.restore, job.elastic)."""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from job import elastic
from job.checkpoint import STATE_FILE, describe, open_checkpoint
from job.exceptions import EXIT_BUG, CheckpointLoadError, ConfigError, exit_code_for
from job.restore import restore
from state import State
from tests.support.checkpoints import checkpoints_of, reseal
from tests.support.hostile import DELETED, HOSTILE, IN_JSON, edit, entries, first_line
from tests.support.jobs import (assert_states_equal, ckpt_config, events, job_cmd, job_env, run_job,
                                train_config, train_state)
from tests.support.users import NOBODY, as_nobody
from uploader import local

Edit = Callable[[dict[str, Any]], Any]
META = HOSTILE["a meta tensor"]  # a tensor without data: job.safe_load refuses it on sight


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of 8 batches stopped after 4, that saved at steps 2 and 4 (the tests copy it, never change it)."""
    folder = tmp_path_factory.mktemp("good") / "ckpts"
    train_state(train_config(max_duration="8ba"), ckpt_config(folder, interval="2ba", async_save=False), stop_at=4)
    return folder


def damaged_copy(good: Path, tmp_path: Path, state: Edit | None = None, manifest: Edit | None = None) -> Path:
    """A copy of ``good`` whose step 4 has ``state`` applied to its state dict (the return value, when
    not None, replaces it) and ``manifest`` to its manifest, sealed again so that it verifies."""
    folder = tmp_path / "ckpts"
    shutil.copytree(good, folder)
    newest = folder / local.checkpoint_name(4)
    if state is not None:
        tree = torch.load(newest / STATE_FILE, weights_only=True)
        edited = state(tree)
        tree = tree if edited is None else edited
        torch.save(tree, newest / STATE_FILE)
    reseal(newest, manifest)
    return folder


def _set(path: str, value: Any) -> Edit:
    return edit(path, value)


def _drop(path: str) -> Edit:
    return edit(path, DELETED)


def _every_parameter(change: Edit) -> Edit:
    """``change`` applied to the optimizer state of every parameter."""
    def edit_all(tree: dict[str, Any]) -> None:
        for per_param in tree["optimizers"]["AdamW"]["state"].values():
            change(per_param)
    return edit_all


def _one_element(path: tuple[Any, ...], value: float) -> Edit:
    """One element in the middle of the tensor at ``path`` (a tuple of the keys themselves) set to ``value``."""
    def apply(tree: dict[str, Any]) -> None:
        tensor = functools.reduce(lambda node, key: node[key], path, tree)
        tensor.view(-1)[tensor.numel() // 2] = value
    return apply


# Each was exit 0 with a run that started over or trained random weights (and replaced the good
# checkpoints of the steps it reached again), or a traceback (exit 1), before job.restore.
DAMAGED_STATES = {
    "an empty state": (lambda tree: {}, "has no model, optimizers, timer, rng"),
    "no Timer in the timer entry": (_set("timer", {}), "its state is at step 0, its manifest at step 4"),
    "no model": (_drop("model"), "has no model"),
    "an empty model": (_set("model", {}), "Missing key"),
    "a timer that is a number": (_set("timer", 5), "damaged"),
    "a step of 10**30": (_set("timer.Timer.batch", 10 ** 30), "its state is at step 10000000000000000000000000000"),
    "an epoch of 2**70": (_set("timer.Timer.epoch", 2 ** 70), "its timer's epoch is"),
    "a batch in the epoch past its end": (_set("timer.Timer.batch_in_epoch", 1000), "its timer's batch_in_epoch"),
    "an rng without torch's": (lambda tree: _drop("torch")(tree["rng"]), "damaged"),
    "a numpy rng position of 10**30": (_set("rng.numpy.pos", 10 ** 30), "damaged"),
    "an optimizer state that is a number": (_set("optimizers.AdamW.state", 5), "damaged"),
    "moments of another shape": (_set("optimizers.AdamW.state.0.exp_avg", torch.zeros(7)),
                                 "optimizer state 'exp_avg' is a tensor of shape (7,) for a parameter of shape"),
    "a learning rate of 'fast'": (_set("optimizers.AdamW.param_groups.0.lr", "fast"), "AdamW 0 group 0 lr is 'fast'"),
    "a learning rate of nan": (_set("optimizers.AdamW.param_groups.0.lr", float("nan")), "AdamW 0 group 0 lr is nan"),
    "a parameter's optimizer state that is a list": (_set("optimizers.AdamW.state.0", []),
                                                     "an optimizer state of a parameter is a list, not a mapping"),
    # Found by replacing every entry of a good checkpoint in turn (test_no_entry_of_a_checkpoint_...) or in review:
    # each of these failed at the first step with a traceback (exit 1), or trained on silently where noted.
    "no state of this run's optimizer (fresh moments, silently)": (_set("optimizers", {}),
                                                                   "its optimizers hold no AdamW state"),
    "a CUDA rng entry of 'x' (only warned without a GPU)": (
        _set("rng.cuda", "x"), "rng state's cuda entry is not a list of CUDA generator states"),
    "moments that are one number": (_set("optimizers.AdamW.state.0.exp_avg", 0.5),
                                    "optimizer state 'exp_avg' is 0.5 for a parameter of shape (128, 2)"),
    "moments that are a tensor of one number": (_set("optimizers.AdamW.state.1.exp_avg_sq", torch.tensor(5.0)),
                                                "'exp_avg_sq' is a tensor of shape () for a parameter of shape (128,)"),
    "every parameter's moments one number": (_every_parameter(_set("exp_avg", 0.5)), "'exp_avg' is 0.5 for a"),
    "a parameter without its second moments": (_drop("optimizers.AdamW.state.2.exp_avg_sq"),
                                               "its AdamW keeps 'exp_avg', 'step' for a parameter, not 'exp_avg', "
                                               "'exp_avg_sq', 'step'"),
    "no parameter with its second moments": (_every_parameter(_drop("exp_avg_sq")),
                                             "its AdamW keeps 'exp_avg', 'step'"),
    "a step count of a whole-number type": (_set("optimizers.AdamW.state.0.step", torch.tensor(2 ** 63 - 1)),
                                            "'step' is a tensor of torch.int64, not of a floating-point type"),
    "sparse moments": (_set("optimizers.AdamW.state.0.exp_avg", torch.zeros(128, 2).to_sparse()),
                       "optimizer state 'exp_avg' is a torch.sparse_coo tensor, not a dense one"),
    "optimizer entries named by 10,000 characters and by a 20x20 tensor": (
        _every_parameter(lambda state: state.update({"x" * 10_000: 0.5, torch.zeros(20, 20): 0.5})),
        "its AdamW keeps 'exp_avg', 'exp_avg_sq', 'step', 'xxxxx"),
    "a step count of nan (NaN weights, silently)": (_set("optimizers.AdamW.state.0.step", torch.tensor(float("nan"))),
                                                    "optimizer state 'step' is nan, not a finite count"),
    "a step count of -1": (_set("optimizers.AdamW.state.0.step", torch.tensor(-1.0)),
                           "optimizer state 'step' is -1.0, not a finite count"),
    "a step count that is a bool": (_set("optimizers.AdamW.state.0.step", torch.tensor(True)),
                                    "optimizer state 'step' is a bool tensor"),
    "moments of a parameter no group lists (fresh moments, silently)": (
        _set("optimizers.AdamW.param_groups.0.params.0", "x"), "holds state for a parameter id that its param_groups"),
    "amsgrad switched on": (_set("optimizers.AdamW.param_groups.0.amsgrad", True),
                            "AdamW 0 group 0 amsgrad is True, this run's optimizer has False"),
    "a maximize of 'x' (climbed the loss, silently)": (
        _set("optimizers.AdamW.param_groups.0.maximize", "x"),
        "AdamW 0 group 0 maximize is 'x', this run's optimizer has False"),
    "no eps": (_drop("optimizers.AdamW.param_groups.0.eps"), "its AdamW param group has no 'eps'"),
    "an eps of 2**70": (_set("optimizers.AdamW.param_groups.0.eps", 2 ** 70), "AdamW 0 group 0 eps is 118059"),
    "a learning rate of -1 (climbed the loss, silently)": (_set("optimizers.AdamW.param_groups.0.lr", -1.0),
                                                          "AdamW 0 group 0 lr is -1.0, below 0"),
    "a beta of 1.5": (_set("optimizers.AdamW.param_groups.0.betas", (0.9, 1.5)),
                      "AdamW 0 group 0 betas are (0.9, 1.5), not each from 0 up to 1"),
    "a scheduler switch that is an empty tensor": (_set("schedulers.CosineAnnealingLR._is_initial", torch.zeros(0)),
                                                   "CosineAnnealingLR 0 _is_initial is tensor([]), not a bool"),
    "a schedule position that is a bool tensor": (_set("schedulers.CosineAnnealingLR.last_epoch", torch.tensor(True)),
                                                  "CosineAnnealingLR 0 last_epoch is tensor(True), not a number"),
    "a schedule position of 'x'": (_set("schedulers.CosineAnnealingLR.last_epoch", "x"),
                                   "CosineAnnealingLR 0 last_epoch is 'x'"),
    "base learning rates of ['x']": (_set("schedulers.CosineAnnealingLR.base_lrs", ["x"]), "base_lrs is ['x']"),
    "schedulers as a list": (_set("schedulers", [1]), "damaged"),
    "train metrics that are a number": (_set("train_metrics", 5), "damaged"),
    "a train metric accumulator of no elements": (
        _set("train_metrics.accuracy.states.tp", torch.zeros(0, dtype=torch.long)),
        "MulticlassAccuracy state 'tp' is (0,) int64 but the metric keeps (1,) int64"),
    "a train metric accumulator of another dtype": (_set("train_metrics.accuracy.states.tp", torch.tensor([True])),
                                                    "MulticlassAccuracy state 'tp' is (1,) bool"),
    "current metrics that are a number": (_set("current_metrics", 5), "current_metrics are not a mapping"),
    "a current metric that is a string": (_set("current_metrics", {"train": {"accuracy": "x"}}),
                                          "current_metrics are not a mapping of metric values"),
    # Review (27th session): each resumed, saved the damage again, then failed at its first evaluation (exit 1)
    "a current metric of 10**400": (_set("current_metrics", {"eval": {"accuracy": 10 ** 400}}),
                                    "current_metrics are not a mapping of metric values"),
    "a current metric that is a meta tensor": (_set("current_metrics", {"eval": {"accuracy": META}}),
                                               "holds a tensor on the meta device"),
    "a current metric named by a tuple": (_set("current_metrics", {"eval": {(1, 2): 0.5}}),
                                          "current_metrics are not a mapping of metric values"),
    # ... and this one trained on, writing 4 MB more in every checkpoint (8 GB at 2**31 elements)
    "a train metric accumulator expanded to 2**20 elements": (
        _set("train_metrics.accuracy.states.tp", torch.zeros(1, dtype=torch.long).expand(2 ** 20)),
        "views 8 bytes that hold fewer than its 1,048,576 elements"),
    "a seed of 'x'": (_set("rank_zero_seed", "x"), "its rank_zero_seed is 'x', not a seed"),
    "a seed of 2**80": (_set("rank_zero_seed", 2 ** 80), "its rank_zero_seed is 1208925819614629174706176"),
    "an integer model key": (lambda tree: tree["model"].__setitem__(7, torch.zeros(2)), "damaged"),
    # A run that diverged, saved before job.checkpoint refused to (exit 8), or elsewhere: each trained NaN from
    # its first step, and ended in exit 8 one checkpoint later, naming this one as the newest to resume. Now
    # refused at the first step's optimizer update (job.resumed_check), before anything is written.
    "one NaN in a weight": (_one_element(("model", "net.3.weight"), float("nan")),
                            "cannot be trained on: its model.net.3.weight holds NaN or Inf"),
    "one Inf in a second moment": (_one_element(("optimizers", "AdamW", "state", 5, "exp_avg_sq"), float("inf")),
                                   "cannot be trained on: its optimizers.AdamW.state.5.exp_avg_sq holds NaN or Inf"),
    "per-rank states that are a number": (_set("per_rank", 5), "per-rank states are not a list of mappings"),
    "per-rank states of numbers": (_set("per_rank", [5, 6]), "per-rank states are not a list of mappings"),
    "train metrics of another rank that are a number": (_set("per_rank", [{}, {"train_metrics": 5}]),
                                                        "per-rank states are not a list of mappings"),
    "a per-rank rng that is a tensor": (_set("per_rank", [{"rng": torch.zeros(3)}, {}]),
                                        "per-rank states are not a list of mappings"),
}


@pytest.mark.parametrize("case", list(DAMAGED_STATES))
@pytest.mark.filterwarnings("ignore:Timer .in timer. is not in the checkpoint:UserWarning")  # State's own leniency
def test_damaged_content_is_refused_before_training_and_loses_nothing(good: Path, tmp_path: Path, case: str) -> None:
    edit, says = DAMAGED_STATES[case]
    folder = damaged_copy(good, tmp_path, state=edit)
    before = checkpoints_of(folder)
    with pytest.raises(CheckpointLoadError, match=f"checkpoint .*{local.checkpoint_name(4)}") as refused:
        train_state(train_config(max_duration="6ba"), ckpt_config(folder, interval="2ba", async_save=False))
    assert says in str(refused.value)
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 1000  # one line, whatever the file holds
    assert checkpoints_of(folder) == before  # step 2 and the damaged step 4 alike: nothing rewritten


@pytest.mark.parametrize("stop_at", [None, 4], ids=["at its end already", "stopped before its first step"])
def test_a_run_that_takes_no_step_refuses_a_diverged_checkpoint_all_the_same(good: Path, tmp_path: Path,
                                                                             stop_at: int | None) -> None:
    """The check is answered at the first step's update, or after the loop when no step ran: before it
    (review), the first of these finished with exit 0 and marked the folder completed on the NaN state, and the
    second was preempted (exit 75) to resume it again; a --resume PATH of it was written and refused as exit 8."""
    folder = damaged_copy(good, tmp_path, state=DAMAGED_STATES["one NaN in a weight"][0])
    before = checkpoints_of(folder)
    with pytest.raises(CheckpointLoadError, match="cannot be trained on: its model.net.3.weight holds NaN or Inf"):
        train_state(train_config(max_duration="4ba" if stop_at is None else "8ba"),
                    ckpt_config(folder, interval="2ba", async_save=False), stop_at=stop_at)
    assert checkpoints_of(folder) == before
    assert local.finished_marker(folder).reason == "failed"


# State's own leniency (Composer's): an entry the checkpoint lacks keeps its value, with this warning.
LENIENT = re.compile(r"is not in the checkpoint|^the checkpoint has no ")


def _one_step_more(folder: Path, failures: list[str], path: tuple[Any, ...]) -> None:
    """Resume ``folder`` with the flags it was written with (nothing refitted over the damage) for one step;
    a warning other than State's leniency is a failure."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        train_state(train_config(max_duration="8ba"), ckpt_config(folder, interval="2ba", async_save=False), stop_at=5)
    failures += [f"{path}: warned {w.message}" for w in warned if not LENIENT.search(str(w.message))]


@pytest.mark.slow
@pytest.mark.parametrize("value", list(HOSTILE))
def test_no_entry_of_a_checkpoint_ends_its_resume_in_a_traceback(good: Path, tmp_path: Path, value: str) -> None:
    """Each entry of a good checkpoint's state in turn set to ``value`` (or deleted), sealed so that it
    verifies, and resumed for a step: the run trains on, or is refused (exit 6) with its checkpoints as they
    were. Never another error, which the CLI prints as a traceback (exit 1). Which values are damage is for
    the table above to say; this finds the entries and values nobody thought of (the table's second part)."""
    tree = torch.load(good / local.checkpoint_name(4) / STATE_FILE, weights_only=True)
    failures = []
    for n, path in enumerate(entries(tree)):
        folder = damaged_copy(good, tmp_path / str(n), state=edit(path, HOSTILE[value]))
        before = checkpoints_of(folder)
        try:
            _one_step_more(folder, failures, path)
        except CheckpointLoadError as e:
            if checkpoints_of(folder) != before or "\n" in str(e):
                failures.append(f"{path}: refused, but the checkpoints changed or in more than one line: {e}")
        except Exception as e:
            failures.append(f"{path}: {first_line(e)}")
        shutil.rmtree(folder)
    assert n > 40 and not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("value", list(IN_JSON))
def test_no_entry_of_a_manifest_ends_a_resume_in_a_traceback(good: Path, tmp_path: Path, value: str) -> None:
    """The same for each entry of the newest checkpoint's manifest (not sealed again: the digests cover the
    files). The run resumes from it or from the step before (this one set aside as corrupt), or stops with
    one line and a documented exit code (a newer format_version asks for an upgrade); never with a traceback
    (a grad_accum of 0 divided by zero, a format_version of [] was unhashable)."""
    doc = json.loads((good / local.checkpoint_name(4) / "manifest.json").read_text())
    failures = []
    for n, path in enumerate(entries(doc)):
        folder = tmp_path / str(n)
        shutil.copytree(good, folder)
        edited = json.loads(json.dumps(doc))
        edit(path, IN_JSON[value])(edited)
        (folder / local.checkpoint_name(4) / "manifest.json").write_text(json.dumps(edited))
        try:
            _one_step_more(folder, failures, path)
        except Exception as e:
            if exit_code_for(e) == EXIT_BUG or "\n" in str(e):  # else one line and a documented exit code
                failures.append(f"{path}: {first_line(e)}")
        shutil.rmtree(folder)
    assert n > 20 and not failures, "\n".join(failures)


def test_a_checkpoint_that_stepped_on_a_gpu_resumes_with_this_runs_way_of_stepping(good: Path, tmp_path: Path) -> None:
    """capturable, fused and foreach say how a machine steps, not what a step computes: a GPU run's
    capturable=True failed an assertion at the first step on the CPU. The run keeps its own flags and
    resumes exactly as from the same checkpoint without them."""
    def stepped_on_a_gpu(tree: dict[str, Any]) -> None:
        tree["optimizers"]["AdamW"]["param_groups"][0].update(capturable=True, fused=True, foreach=True)

    flags = train_config(max_duration="6ba"), ckpt_config(tmp_path, interval="2ba", async_save=False)
    resumed = train_state(flags[0], replace(flags[1], folder=damaged_copy(good, tmp_path / "gpu", stepped_on_a_gpu)))
    plain = train_state(flags[0], replace(flags[1], folder=damaged_copy(good, tmp_path / "cpu")))
    assert_states_equal(resumed, plain)
    group = resumed.optimizers[0].param_groups[0]
    assert (group["capturable"], group["fused"], group["foreach"]) == (False, None, None)


def _past_the_epoch(doc: dict[str, Any]) -> None:
    doc["timer"]["batch_in_epoch"] = 1000


@pytest.mark.parametrize("state, manifest, says", [
    (None, lambda doc: doc["meta"].__setitem__("world_size", "two"),
     "is damaged: its manifest records world_size 'two', not a number of ranks"),
    (None, lambda doc: doc["meta"].__setitem__("world_size", 0), "is damaged: its manifest records world_size 0"),
    (None, lambda doc: doc["meta"].update(global_batch=10 ** 15),
     "was written for other --data, or is damaged: its global batch does not fit this data"),
    (None, lambda doc: doc["meta"].update(global_batch="64"), "is damaged: its manifest records global_batch '64'"),
    (None, lambda doc: doc["meta"].update(global_batch=64.5), "is damaged: its manifest records global_batch 64.5"),
    (None, lambda doc: doc["meta"].update(micro_batch=0), "is damaged: its manifest records micro_batch 0, not a"),
    (None, lambda doc: doc["meta"].update(micro_batch=True), "is damaged: its manifest records micro_batch True"),
    (None, lambda doc: doc["meta"].update(micro_batch=2 ** 70),  # trained on, the share in one micro-batch (review)
     "is damaged: its manifest records micro_batch 1180591620717411303424, more than its global_batch of 64"),
    # State and manifest agree (job.restore's checks pass), but this data's epoch is shorter.
    (_set("timer.Timer.batch_in_epoch", 1000), _past_the_epoch,
     "is at batch 1000 of its epoch, but an epoch of this data has"),
], ids=["world_size 'two'", "world_size 0", "a global batch of 10**15", "global_batch '64'", "global_batch 64.5",
        "micro_batch 0", "micro_batch True", "micro_batch 2**70", "a position past this data's epoch"])
def test_a_damaged_manifest_meta_is_refused_naming_the_checkpoint(good: Path, tmp_path: Path, state: Edit | None,
                                                                  manifest: Edit, says: str) -> None:
    """These are found after job.restore, when the global batch is planned (job.elastic): the error names
    the checkpoint as job.restore's do (it once said "the checkpoint")."""
    folder = damaged_copy(good, tmp_path, state=state, manifest=manifest)
    before = checkpoints_of(folder)
    named = f"checkpoint {folder / local.checkpoint_name(4)} {says}"
    with pytest.raises(CheckpointLoadError, match=f"^{re.escape(named)}"):
        train_state(train_config(max_duration="6ba"), ckpt_config(folder, interval="2ba", async_save=False))
    assert checkpoints_of(folder) == before


@pytest.mark.parametrize("grad_accum", [0, 0.5, "x"])
def test_a_micro_batch_on_record_is_planned_from_whatever_grad_accum_says(grad_accum: Any) -> None:
    """grad_accum only matters to checkpoints without a micro_batch: 0 once divided by zero (exit 1) anyway."""
    meta = {"global_batch": 64, "micro_batch": 16, "world_size": 1, "batch_size": 64, "grad_accum": grad_accum}
    plan = elastic.resumed_plan(meta, train_config(), world=2)
    assert (plan.global_batch, plan.micro_batch, plan.grad_accum) == (64, 16, 2)
    del meta["micro_batch"]  # nothing to plan from: the flags decide, as for any checkpoint without the settings
    assert elastic.resumed_plan(meta, train_config(), world=2).global_batch == 128


def test_an_odd_global_batch_of_10_to_the_12_is_answered_at_once() -> None:
    """The advice lists rank counts that divide it; it once tried every number up to the global batch."""
    meta = {"global_batch": 10 ** 12 + 1, "micro_batch": 2, "world_size": 1, "batch_size": 2, "grad_accum": 1}
    with pytest.raises(ConfigError, match=r"resume it on 1, 73, 137 ranks"):
        elastic.resumed_plan(meta, train_config(), world=2)


@pytest.mark.parametrize("case", ["an empty state", "one NaN in a weight"])
def test_the_cli_says_one_line_exit_6_and_keeps_the_good_checkpoints(good: Path, tmp_path: Path, case: str) -> None:
    damage, says = DAMAGED_STATES[case]
    folder = damaged_copy(good, tmp_path, state=damage)
    before = checkpoints_of(folder)
    done = run_job("train", "--max-duration", "6ba", "--save-interval", "2ba", "--save-folder", str(folder),
                   "--log-format", "json")
    assert done.returncode == 6, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("job: error: checkpoint") and says in last and "Traceback" not in done.stderr
    assert checkpoints_of(folder) == before


@pytest.mark.parametrize(("state", "manifest", "says"), [
    (_set("timer.Timer.sample", 2 ** 63 - 11), _set("timer.sample", 2 ** 63 - 11), "sample is 9223372036854775797"),
    (_set("timer.Timer.epoch", 10 ** 30), _drop("timer.epoch"), "epoch is 1000000000000000000000000000000"),
], ids=["near-the-end-of-int64", "not-in-the-manifest"])
def test_a_timer_count_without_room_to_count_on_is_damage(good: Path, tmp_path: Path, state: Edit, manifest: Edit,
                                                          says: str) -> None:
    """Its manifest agreeing, a count near int64's end resumed, then wrote checkpoints every later start refused,
    going back to it each time (review)."""
    folder = damaged_copy(good, tmp_path, state=state, manifest=manifest)
    before = checkpoints_of(folder)
    with pytest.raises(CheckpointLoadError, match=re.escape(f"its timer's {says}, beyond the 2**62")):
        train_state(train_config(max_duration="6ba"), ckpt_config(folder, interval="2ba", async_save=False))
    assert checkpoints_of(folder) == before


@pytest.mark.parametrize("unreadable", [STATE_FILE, "manifest.json"])
def test_a_checkpoint_file_this_user_may_not_read_is_exit_3_and_never_set_aside(good: Path, unreadable: str) -> None:
    """A good checkpoint whose file the job may not read (another uid wrote it, a volume's modes) was set aside
    as corrupt, and the run resumed the one before it, its work lost to a permission (review)."""
    with tempfile.TemporaryDirectory() as top:  # pytest's tmp_path lies in a folder only its owner may enter
        done, folder, before = _resume_with_a_file_it_may_not_read(good, Path(top), 4, unreadable)
        newest = folder / local.checkpoint_name(4)
        assert done.returncode == 3, done.stderr[-2000:]
        what = "cannot read its manifest.json" if unreadable == "manifest.json" else f"{unreadable} cannot be read"
        assert done.stderr.strip().splitlines()[-1] == (
            f"job: error: {newest}: {what} (Permission denied): run as a user that may read the checkpoint (the uid "
            "that wrote it, or a shared group and fsGroup); it is left as it is")
        assert checkpoints_of(folder) == before and not list(folder.glob("corrupt-*"))


def test_an_older_checkpoint_this_user_may_not_read_neither_stops_the_run_nor_is_pruned(good: Path) -> None:
    """Listing every checkpoint (node parts, retention) read each one's manifest: one older that the job may
    not read stopped every start with exit 3 (second review). It is left as it is, with a warning."""
    with tempfile.TemporaryDirectory() as top:
        done, folder, before = _resume_with_a_file_it_may_not_read(good, Path(top), 2, "manifest.json", keep="1")
        assert done.returncode == 0, done.stderr[-2000:]
        assert [e["step"] for e in events(done.stderr) if e.get("event") == "resumed"] == [4]
        assert "is neither counted nor deleted" in done.stderr
        assert [c.step for c in local.list_committed(folder)] == [2, 6]  # step 4 pruned, step 2 kept
        kept = local.checkpoint_name(2) + "/"
        assert ({k: v for k, v in checkpoints_of(folder).items() if k.startswith(kept)}
                == {k: v for k, v in before.items() if k.startswith(kept)} != {})


def _resume_with_a_file_it_may_not_read(good: Path, tmp_path: Path, step: int, unreadable: str, keep: str = "3"
                                        ) -> tuple[subprocess.CompletedProcess[str], Path, Any]:
    """Resume a copy of ``good`` for 2 steps, as a user who may not read ``unreadable`` of step ``step``. Root
    reads anything: the job runs as nobody then, and the file stays root's."""
    tmp_path.chmod(0o755)
    folder = damaged_copy(good, tmp_path)
    closed = folder / local.checkpoint_name(step) / unreadable
    as_root = os.geteuid() == 0
    if as_root:
        for path in [folder, *folder.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
        os.chown(closed, 0, 0)
    closed.chmod(0o600 if as_root else 0)
    before = checkpoints_of(folder)
    command = job_cmd("train", "--max-duration", "6ba", "--save-interval", "2ba", "--keep", keep, "--sync-save",
                      "--log-format", "json", "--save-folder", str(folder))
    done = subprocess.run(as_nobody(command), env=job_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    closed.chmod(0o644)
    return done, folder, before


@pytest.mark.parametrize("model", [5, [1, 2], {7: torch.zeros(2)}])
def test_inspect_calls_a_malformed_model_entry_damaged(good: Path, tmp_path: Path, model: Any) -> None:
    folder = damaged_copy(good, tmp_path, state=_set("model", model))
    with pytest.raises(CheckpointLoadError, match="its model entry .* it is damaged"):
        describe(*open_checkpoint(folder / local.checkpoint_name(4)))


@pytest.mark.parametrize("model", [{"w": torch.zeros(1).expand(2 ** 20)}, {"w": META}], ids=["expanded", "meta"])
def test_inspect_refuses_a_model_tensor_no_save_writes(good: Path, tmp_path: Path, model: Any) -> None:
    """An expanded view made ``job inspect`` allocate every element it views (4.5 GB from a 1.5 KB file at
    2**29 elements, in review) to hash the model."""
    folder = damaged_copy(good, tmp_path, state=_set("model", model))
    with pytest.raises(CheckpointLoadError, match=r"state\.pt is damaged or hostile: (a tensor of shape|it holds)"):
        describe(*open_checkpoint(folder / local.checkpoint_name(4)))


def test_the_sealed_copy_of_a_good_checkpoint_still_resumes(good: Path, tmp_path: Path) -> None:
    """The tests' own control: a copy sealed again without a change resumes and trains on."""
    folder = damaged_copy(good, tmp_path, state=lambda tree: None)
    state = train_state(train_config(max_duration="6ba"), ckpt_config(folder, interval="2ba", async_save=False))
    assert state.timer.batch.value == 6


def test_a_setting_the_checkpoint_lacks_is_no_damage(good: Path, tmp_path: Path) -> None:
    """A run without a schedule (a --max-duration in tokens) saved no initial_lr; resumed with a schedule
    it resumes (job.build.refit_schedule sets the new one up), as it did before job.restore."""
    folder = damaged_copy(good, tmp_path, state=lambda tree: _drop("initial_lr")(
        tree["optimizers"]["AdamW"]["param_groups"][0]))
    state = train_state(train_config(max_duration="6ba"), ckpt_config(folder, interval="2ba", async_save=False))
    assert state.timer.batch.value == 6


@pytest.mark.filterwarnings("ignore:CosineAnnealingLR .in schedulers. is not in the checkpoint:UserWarning")
def test_a_checkpoint_without_a_schedule_resumes_at_its_step_of_the_new_one(good: Path, tmp_path: Path) -> None:
    """A run without a schedule then saved neither a scheduler nor initial_lr. Resumed with one, the new
    schedule is followed from the checkpoint's step, as if the run had had it all along; it once started
    again from its first step there (2 of 8 at step 6, not 6 of 8)."""
    def no_schedule(tree: dict[str, Any]) -> None:
        tree["schedulers"] = {}
        del tree["optimizers"]["AdamW"]["param_groups"][0]["initial_lr"]

    cfg = train_config(max_duration="8ba")
    resumed = train_state(cfg, ckpt_config(damaged_copy(good, tmp_path, no_schedule), async_save=False), stop_at=6)
    fresh = train_state(cfg, ckpt_config(tmp_path / "fresh", async_save=False), stop_at=6)
    assert resumed.schedulers[0].last_epoch == fresh.schedulers[0].last_epoch == 6
    assert resumed.optimizers[0].param_groups[0]["lr"] == pytest.approx(fresh.optimizers[0].param_groups[0]["lr"],
                                                                        rel=1e-9)


def test_a_parameter_of_no_dimensions_resumes_from_its_own_checkpoint() -> None:
    """A scalar parameter (a learned temperature) has moments of no dimensions, like its step count: such a
    checkpoint was once taken for one that mixes numbers and moments, and refused."""
    def stepped(steps: int) -> State:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        model.temperature = torch.nn.Parameter(torch.tensor(1.0))
        state = State(model=model, max_duration="4ba", rank_zero_seed=0, train_dataloader=[0] * 4,
                      optimizers=torch.optim.AdamW(model.parameters()))
        for _ in range(steps):
            (model(torch.ones(3)).sum() * model.temperature).backward()
            state.optimizers[0].step()
        return state

    saved, resumed = stepped(2), stepped(0)
    restore(resumed, saved.state_dict(), "a checkpoint", 0, {})
    moments = resumed.optimizers[0].state[resumed.model.temperature]
    assert moments["exp_avg"].dim() == 0 and torch.equal(moments["exp_avg"],
                                                         saved.optimizers[0].state[saved.model.temperature]["exp_avg"])


def _scaled_state(steps: int = 0) -> State:
    """A State with AMP's loss scaler (its CPU flavour: the job's amp_fp16 one needs CUDA), after ``steps``
    scaled steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    state = State(model=model, max_duration="4ba", rank_zero_seed=0, train_dataloader=[0] * 4,
                  optimizers=torch.optim.SGD(model.parameters(), lr=0.1), scaler=torch.amp.GradScaler("cpu"))
    for _ in range(steps):
        state.scaler.scale(model(torch.ones(2)).sum()).backward()
        state.scaler.step(state.optimizers[0])
        state.scaler.update()
    return state


# Each loaded without a word: the first two failed at the first step (TypeError, OverflowError), a scale
# of 0 made the weights NaN at the first step.
DAMAGED_SCALERS = {
    "a scale of 'x'": ("scale", "x", "is damaged: its GradScaler scale is 'x', not a finite number, 0 or above"),
    "a growth tracker of 10**30": ("_growth_tracker", 10 ** 30, "is damaged: its GradScaler _growth_tracker is "
                                   "1000000000000000000000000000000, not a whole number of steps from 0 to 2**31-1"),
    "a scale of -1": ("scale", -1.0, "is damaged: its GradScaler scale is -1.0, not a finite number, 0 or above"),
    # Not damage: torch halves the scale at each overflowing step, to 0 after about 166 in a row.
    "a scale backed off to 0": ("scale", 0.0, "cannot be trained on: its loss scale (--precision amp_fp16) backed "
                                "off to 0"),
    "a scale of inf": ("scale", float("inf"), "is damaged: its GradScaler scale is inf"),
    "a scale of 10**400": ("scale", 10 ** 400, "is damaged: its GradScaler scale is 1000"),
    "a growth factor of 0.5": ("growth_factor", 0.5, "is damaged: its GradScaler growth_factor is 0.5, not a finite "
                               "number above 1"),
    "a backoff factor of 1": ("backoff_factor", 1.0, "is damaged: its GradScaler backoff_factor is 1.0, not a number "
                              "between 0 and 1"),
    "a growth interval of 2.5": ("growth_interval", 2.5, "is damaged: its GradScaler growth_interval is 2.5, not a "
                                 "whole number of steps from 1 to 2**31-1"),
    "a growth interval of True": ("growth_interval", True, "is damaged: its GradScaler growth_interval is True"),
    "a growth tracker at its interval": ("_growth_tracker", 2000, "is damaged: its GradScaler counted 2000 steps "
                                         "towards a growth_interval of 2000"),
    "no scale": ("scale", None, "does not fit this model/optimizer or is damaged ('scale')"),  # torch's KeyError
}


@pytest.mark.parametrize("case", list(DAMAGED_SCALERS))
def test_a_damaged_loss_scaler_is_refused(case: str) -> None:
    name, value, says = DAMAGED_SCALERS[case]
    tree = _scaled_state(steps=3).state_dict()
    if value is None:
        del tree["scaler"]["GradScaler"][name]
    else:
        tree["scaler"]["GradScaler"][name] = value
    with pytest.raises(CheckpointLoadError, match="^checkpoint here ") as refused:
        restore(_scaled_state(), tree, "here", 0, {})
    assert says in str(refused.value)


def test_a_run_whose_loss_scale_backed_off_to_0_is_refused_as_one_that_cannot_go_on() -> None:
    """torch's own updates reach a scale of 0: every step overflowing (here an infinite loss), halved each
    time, float32 underflows. The message says so, and not that the checkpoint is damaged."""
    diverged = _scaled_state()
    model, optimizer, scaler = diverged.model, diverged.optimizers[0], diverged.scaler
    steps = 0
    while scaler.get_scale() > 0:
        scaler.scale(model(torch.ones(2)).sum() * float("inf")).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        steps += 1
    assert 100 < steps < 200
    with pytest.raises(CheckpointLoadError, match="^checkpoint here cannot be trained on: its loss scale"):
        restore(_scaled_state(), diverged.state_dict(), "here", 0, {})


def test_a_loss_scaler_restores_and_scales_on() -> None:
    """The control: a scaler that has stepped restores as it was, and the next scaled step runs."""
    saved = _scaled_state(steps=3)
    resumed = _scaled_state()
    restore(resumed, saved.state_dict(), "here", 0, {})
    assert resumed.scaler.state_dict() == saved.scaler.state_dict()
    assert resumed.scaler.state_dict()["_growth_tracker"] == 3
    resumed.scaler.scale(resumed.model(torch.ones(2)).sum()).backward()
    resumed.scaler.step(resumed.optimizers[0])
    resumed.scaler.update()
    assert resumed.scaler.state_dict()["_growth_tracker"] == 4
