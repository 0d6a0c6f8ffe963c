"""Issue 17: resume on whatever capacity comes back. Real torchrun processes on CPU (gloo).

A run keeps its global batch across resumes on other rank counts: every sample of the epoch is trained
exactly once (the recording model writes down what it trains on), and the final weights are close to an
uninterrupted run's on the original rank count (the same samples in the same global batches; only the
floating-point order of the gradient reduction differs).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torchmetrics

from job.checkpoint import STATE_FILE, open_checkpoint
from job.exceptions import CheckpointLoadError
from tests.support.checkpoints import reseal
from tests.support.elastic import DATASET, assert_close, final_model, resumed, run
from tests.support.jobs import events
from tests.support.recording_model import tokens_of, trained

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    """The whole epoch without a stop, on 2 ranks (--batch-size 48) and on 1 (--batch-size 96)."""
    out = {}
    for ranks, flags in ((2, ["--batch-size", "48", "--grad-accum", "2"]), (1, ["--batch-size", "96", "--grad-accum", "4"])):
        base = tmp_path_factory.mktemp(f"straight{ranks}")
        done = run(ranks, base / "ck", base / "record", *flags)
        assert done.proc.returncode == 0, done.stderr[-3000:]
        assert sorted(trained(base / "record")) == list(range(DATASET))
        out[ranks] = final_model(base / "ck")
    return out


def test_2_then_1_then_3_ranks_train_every_sample_once_and_end_close(tmp_path: Path, uninterrupted) -> None:
    folder, record = tmp_path / "ck", tmp_path / "record"
    first = run(2, folder, record, "--batch-size", "48", "--grad-accum", "2", stop_after=6)
    assert first.proc.returncode != 0 and any(e.get("event") == "preempted" for e in events(first.stderr))
    # The flags a new, smaller or larger, cluster would be started with: the checkpoint's global batch wins.
    second = run(1, folder, record, "--batch-size", "48", "--grad-accum", "2", stop_after=18)
    assert any(e.get("event") == "preempted" for e in events(second.stderr)), second.stderr[-3000:]
    third = run(3, folder, record, "--batch-size", "48", "--grad-accum", "2", "--num-workers", "2")
    assert third.proc.returncode == 0, third.stderr[-3000:]

    assert resumed(second, third) == [(2, 1), (1, 3)]
    assert sorted(trained(record)) == list(range(DATASET))  # every sample of the epoch exactly once
    assert_close(final_model(folder), uninterrupted[2])


def test_1_then_2_ranks_mid_epoch(tmp_path: Path, uninterrupted) -> None:
    folder, record = tmp_path / "ck", tmp_path / "record"
    run(1, folder, record, "--batch-size", "96", "--grad-accum", "4", stop_after=10)
    done = run(2, folder, record, "--batch-size", "96", "--grad-accum", "4")
    assert done.proc.returncode == 0, done.stderr[-3000:]
    assert resumed(done) == [(1, 2)]
    assert sorted(trained(record)) == list(range(DATASET))
    assert_close(final_model(folder), uninterrupted[1])


def test_tokens_are_the_job_s_on_every_rank_and_a_duration_in_tokens_ends_them_together(tmp_path: Path) -> None:
    """Samples of different lengths: each rank counted its own tokens times the number of ranks, which is
    not the job's count and not the same on every rank; with --max-duration in tokens one rank stopped
    while the other went on to its next step's collectives, and the run hung."""
    folder, record = tmp_path / "ck", tmp_path / "record"
    done = run(2, folder, record, "--model", "tests.support.recording_model:build_counting_tokens",
               "--batch-size", "48", "--max-duration", "2000tok")
    assert done.proc.returncode == 0, done.stderr[-3000:]
    _, manifest = open_checkpoint(folder)
    assert manifest.timer["sample"] == len(trained(record)) == manifest.timer["batch"] * 96
    per_rank = [[int(i) for i in p.read_text().split()] for p in sorted(record.glob("trained-*.txt"))]
    steps = [sum(tokens_of(i) for rank in per_rank for i in rank[48 * k:48 * (k + 1)])
             for k in range(manifest.timer["batch"])]
    assert manifest.timer["token"] == sum(steps) >= 2000 > sum(steps[:-1])  # the first step that reached it


def test_a_global_batch_that_does_not_divide_is_refused_before_training(tmp_path: Path) -> None:
    folder, record = tmp_path / "ck", tmp_path / "record"
    first = run(2, folder, record, "--batch-size", "32", "--grad-accum", "1", stop_after=4)  # global batch 64
    assert any(e.get("event") == "preempted" for e in events(first.stderr))
    before = len(trained(record))
    refused = run(3, folder, record, "--batch-size", "32", "--grad-accum", "1")
    errors = [line for line in refused.stderr.splitlines() if line.startswith("job: error:")]
    assert errors and all("does not divide among 3 ranks" in e and "1, 2, 4, 8, 16, 32, 64" in e for e in errors)
    assert len(trained(record)) == before  # nothing trained
    assert "resumed" not in {e.get("event") for e in events(refused.stderr)}  # nor counted as a resume


def test_a_state_damaged_for_one_rank_only_is_refused_by_every_rank(tmp_path: Path) -> None:
    """Rank 1's RNG state is damaged, rank 0's is good: rank 1 alone refused it, and rank 0 went on into
    training alone (a hang until the collective's timeout). Now every rank refuses it, nothing trains."""
    folder, record = tmp_path / "ck", tmp_path / "record"
    first = run(2, folder, record, "--batch-size", "32", "--grad-accum", "1", stop_after=4)
    assert any(e.get("event") == "preempted" for e in events(first.stderr))
    newest, _ = open_checkpoint(folder)
    tree = torch.load(newest / STATE_FILE, weights_only=True)
    tree["per_rank"][1]["rng"]["torch"] = 5
    torch.save(tree, newest / STATE_FILE)
    reseal(newest)
    before = len(trained(record))

    refused = run(2, folder, record, "--batch-size", "32", "--grad-accum", "1")

    errors = [line for line in refused.stderr.splitlines() if line.startswith("job: error:")]
    assert refused.proc.returncode != 0 and len(errors) == 2, refused.stderr[-3000:]
    assert all("does not fit this model/optimizer or is damaged" in e for e in errors)
    assert sum("(seen by another rank)" in e for e in errors) == 1
    assert len(trained(record)) == before


def test_a_batch_with_string_ids_resumes_on_fewer_ranks(tmp_path: Path) -> None:
    """Fewer ranks force gradient accumulation (2 micro-batches here): the string ids default_collate leaves
    in a list are cut with the tensors. The resume failed with a traceback (exit 1), every restart again."""
    folder, record = tmp_path / "ck", tmp_path / "record"
    flags = ["--batch-size", "32", "--grad-accum", "1", "--data", "tests.support.recording_model:named_dataset"]
    first = run(2, folder, record, *flags, stop_after=4)
    assert any(e.get("event") == "preempted" for e in events(first.stderr)), first.stderr[-3000:]
    second = run(1, folder, record, *flags)
    assert second.proc.returncode == 0, second.stderr[-3000:]
    assert resumed(second) == [(2, 1)]
    assert sorted(trained(record)) == list(range(DATASET))


def test_a_larger_cluster_keeps_the_checkpoint_s_global_batch_where_the_flags_exceed_the_data(tmp_path: Path) -> None:
    """--batch-size 2048 on 2 ranks is more than the 3072 samples: a new run is refused (exit 2), but a resume of
    a run started on 1 rank keeps the checkpoint's 2048 and ignores the flags, as the README says. The resume
    was refused, because the build checked the flags before the checkpoint's global batch was known."""
    folder, record = tmp_path / "ck", tmp_path / "record"
    flags = ["--batch-size", "2048", "--grad-accum", "2", "--max-duration", "3ep", "--log-interval", "1"]
    refused = run(2, tmp_path / "new", record, *flags)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("job: error:")]
    assert len(errors) == 2 and all("global batch larger than the training set (3072" in e for e in errors), errors
    assert trained(record) == []
    first = run(1, folder, record, *flags, stop_after=1)
    assert any(e.get("event") == "preempted" for e in events(first.stderr)), first.stderr[-3000:]
    second = run(2, folder, record, *flags)
    assert second.proc.returncode == 0, second.stderr[-3000:]
    assert resumed(second) == [(1, 2)]
    assert "keeping the checkpoint's global batch of 2048 samples" in second.stderr
    assert len(trained(record)) == 3 * 2048  # one global batch of 2048 per epoch, each trained once


# -- the pieces, in-process ------------------------------------------------------------------------


@pytest.mark.parametrize(("per_rank", "micro", "accum"), [(96, 24, 4), (32, 24, 2), (30, 24, 2), (7, 3, 7), (24, 24, 1)])
def test_micro_batches_are_never_larger_than_the_first_start_s(per_rank: int, micro: int, accum: int) -> None:
    from job.elastic import BatchPlan

    plan = BatchPlan(global_batch=per_rank * 2, micro_batch=micro, world=2)
    assert plan.grad_accum == accum and plan.per_rank % accum == 0 and plan.per_rank // accum <= micro


def test_a_checkpoint_without_a_recorded_global_batch_derives_it() -> None:
    from job.elastic import LEGACY_SCHEME, resumed_plan
    from job.exceptions import ConfigError
    from tests.support.jobs import train_config

    old = {"batch_size": 32, "grad_accum": 2, "world_size": 2}  # what manifests held before
    plan = resumed_plan(old, train_config(batch_size=32, grad_accum=2), world=4)
    assert (plan.global_batch, plan.per_rank, plan.micro_batch, plan.grad_accum, plan.scheme) == (64, 16, 16, 1, LEGACY_SCHEME)
    with pytest.raises(ConfigError, match="global batch of 64 samples does not divide among 3 ranks.*1, 2, 4, 8, 16, 32, 64"):
        resumed_plan(old, train_config(batch_size=32, grad_accum=2), world=3)


def test_train_metrics_of_the_old_ranks_are_merged_into_new_rank_0() -> None:
    from torchmetrics.classification import MulticlassAccuracy

    from job.elastic import merge_metrics
    from state.metrics import metric_state

    torch.manual_seed(0)
    parts = [(torch.randn(50, 3), torch.randint(0, 3, (50,))) for _ in range(3)]
    everything = MulticlassAccuracy(num_classes=3, average="micro")
    ranks = [MulticlassAccuracy(num_classes=3, average="micro") for _ in parts]
    for metric, (preds, target) in zip(ranks, parts):
        metric.update(preds, target)
        everything.update(preds, target)
    merge_metrics({"accuracy": ranks[0]}, [{"accuracy": metric_state(m)} for m in ranks[1:]])
    assert torch.equal(ranks[0].compute(), everything.compute()) and ranks[0]._update_count == 3


class TwoSums(torchmetrics.Metric):
    """Written as torchmetrics' guide shows, without ``full_state_update``: torchmetrics' merge_state refuses it."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.total += (preds.argmax(-1) == target).sum()
        self.count += target.numel()

    def compute(self) -> torch.Tensor:
        return self.total / self.count


@pytest.mark.parametrize("make", [TwoSums, lambda: torchmetrics.MaxMetric()], ids=["custom", "max"])
def test_a_metric_torchmetrics_will_not_merge_is_merged_by_its_reductions(make: Any) -> None:
    """merge_state refuses every metric whose full_state_update is True or unset (a custom metric by default):
    such a checkpoint was "damaged" (exit 6) on any other number of ranks."""
    from job.elastic import merge_metrics
    from state.metrics import metric_state

    torch.manual_seed(0)
    parts = [(torch.randn(50, 3), torch.randint(0, 3, (50,))) for _ in range(3)]
    everything, ranks = make(), [make() for _ in parts]
    for metric, (preds, target) in zip(ranks, parts):
        args = (preds, target) if isinstance(metric, TwoSums) else (preds,)
        metric.update(*args)
        everything.update(*args)
    merge_metrics({"m": ranks[0]}, [{"m": metric_state(m)} for m in ranks[1:]])
    assert torch.equal(ranks[0].compute(), everything.compute()) and ranks[0]._update_count == 3


def test_list_states_without_a_reduction_are_joined() -> None:
    """Retrieval metrics keep their predictions in lists without a reduction: joined, as torchmetrics joins them."""
    from torchmetrics.retrieval import RetrievalMAP

    from job.elastic import merge_metrics
    from state.metrics import metric_state

    parts = [(torch.tensor([.9, .1, .8]), torch.tensor([1, 0, 0]), torch.tensor([0, 0, 1])),
             (torch.tensor([.2, .7, .3]), torch.tensor([1, 0, 1]), torch.tensor([2, 2, 3]))]
    ranks, everything = [RetrievalMAP() for _ in parts], RetrievalMAP()
    for metric, part in zip(ranks, parts):
        metric.update(*part)
        everything.update(*part)
    merge_metrics({"map": ranks[0]}, [{"map": metric_state(ranks[1])}])
    assert torch.equal(ranks[0].compute(), everything.compute()) and ranks[0]._update_count == 2


class Averaged(torchmetrics.Metric):
    """A state reduced by "mean": torchmetrics' merge weighs it as one forward step, not as another rank."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("level", default=torch.tensor(0.0), dist_reduce_fx="mean")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        self.level = preds.mean()

    def compute(self) -> torch.Tensor:
        return self.level


class AveragedDeclared(Averaged):
    """The same, declared as torchmetrics' merge_state allows: it averaged the two ranks' states as two steps."""

    full_state_update = False


@pytest.mark.parametrize("make", [lambda: torchmetrics.PearsonCorrCoef(), Averaged, AveragedDeclared],
                         ids=["pearson", "mean", "mean-declared"])
def test_a_metric_whose_states_cannot_be_combined_keeps_rank_0_s_with_a_warning(caplog, make: Any) -> None:
    """Pearson's running moments have no reduction: merged, they would be stacked and then updated on. A "mean"
    state was merged as if the other rank's were one more step of this one: wrong numbers, silently."""
    from job.elastic import merge_metrics
    from state.metrics import metric_state

    torch.manual_seed(0)
    ranks = [make() for _ in range(2)]
    for metric in ranks:
        metric.update(torch.randn(20), torch.randn(20))
    alone = metric_state(ranks[0])
    merge_metrics({"m": ranks[0]}, [{"m": metric_state(ranks[1])}])
    assert all(torch.equal(a, b) for a, b in zip(metric_state(ranks[0])["states"].values(), alone["states"].values()))
    assert "train metric(s) m cannot be merged" in caplog.text
    ranks[0].update(torch.randn(20), torch.randn(20))  # and it trains on
    assert torch.isfinite(ranks[0].compute())


def test_a_new_rank_s_rng_is_derived_from_seed_rank_and_step() -> None:
    from job.elastic import derived_rng
    from state.rng import capture_rng

    before = torch.get_rng_state()
    a, b, c = derived_rng(5, 3, 100), derived_rng(5, 3, 100), derived_rng(5, 4, 100)
    assert torch.equal(torch.get_rng_state(), before)  # the current streams are left alone
    assert torch.equal(a["torch"], b["torch"]) and not torch.equal(a["torch"], c["torch"])
    assert set(a) == set(capture_rng())


@pytest.mark.parametrize("rng", [None, {}], ids=["without-rng", "empty-rng"])
def test_an_old_rank_without_its_rng_is_damage_on_another_number_of_ranks_too(rng: dict[str, Any] | None) -> None:
    """Only a rank the old run did not have derives its streams. Old rank 0's missing was taken for a new
    rank's, and the run trained on with derived streams, silently (review); on the same number of ranks it
    was refused already."""
    from job.elastic import for_this_rank
    from state.rng import capture_rng

    per_rank = [{} if rng is None else {"rng": rng}, {"rng": capture_rng()}]
    with pytest.raises(CheckpointLoadError, match="damaged: the state of its rank 0 has no rng"):
        for_this_rank({"per_rank": per_rank}, 0, 1, seed=5, step=10, source="ck")
    assert for_this_rank({"per_rank": per_rank}, 2, 3, seed=5, step=10, source="ck").tree["rng"] is not None

