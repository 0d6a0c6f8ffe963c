"""metric_state / load_metric_state: torchmetrics accumulators restored bit for bit."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import torch
from torchmetrics import CatMetric, MeanMetric, Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassPrecision
from torchmetrics.image import PeakSignalNoiseRatio
from torchmetrics.regression import KLDivergence, R2Score

from state import StateError
from state.metrics import as_metric_dict, load_metric_state, metric_state
from tests.state.helpers import assert_nested_equal, save_and_load

NUM_CLASSES = 4


def _batches(count: int, offset: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + offset)
    return [
        (torch.randn(6, NUM_CLASSES, generator=generator), torch.randint(0, NUM_CLASSES, (6,), generator=generator))
        for _ in range(count)
    ]


def _update(metric: Metric | MetricCollection, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for logits, targets in batches:
        if isinstance(metric, (MeanMetric, CatMetric)):
            metric.update(logits.softmax(dim=1)[:, 0])
        else:
            metric.update(logits, targets)


METRICS: dict[str, Callable[[], Metric | MetricCollection]] = {
    "accuracy": lambda: MulticlassAccuracy(num_classes=NUM_CLASSES),
    "mean": MeanMetric,
    "cat (list state)": CatMetric,
    "collection": lambda: MetricCollection(
        {
            "accuracy": MulticlassAccuracy(num_classes=NUM_CLASSES),
            "precision": MulticlassPrecision(num_classes=NUM_CLASSES),
        }
    ),
}


@pytest.mark.parametrize("make", METRICS.values(), ids=METRICS.keys())
def test_restore_is_bit_exact_for_compute_and_later_updates(make: Callable[[], Metric | MetricCollection]) -> None:
    original = make()
    _update(original, _batches(3))
    snapshot = save_and_load(metric_state(original))

    restored = make()
    _update(restored, _batches(2, offset=7))  # unrelated history that the restore must erase
    load_metric_state(restored, snapshot)
    assert_nested_equal(restored.compute(), original.compute())

    later = _batches(2, offset=1)
    _update(original, later)
    _update(restored, later)
    assert_nested_equal(restored.compute(), original.compute())


def test_state_includes_non_persistent_states_and_update_count() -> None:
    metric = MeanMetric()
    assert metric.state_dict() == {}  # why this module exists: torchmetrics saves nothing by default
    _update(metric, _batches(3))
    state = metric_state(metric)
    assert state["update_count"] == 3
    assert set(state["states"]) == {"mean_value", "weight"}


def test_snapshot_does_not_change_as_training_continues() -> None:
    metric = MeanMetric()
    _update(metric, _batches(1))
    state = metric_state(metric)
    frozen = state["states"]["weight"].clone()
    _update(metric, _batches(2))
    assert torch.equal(state["states"]["weight"], frozen)


def test_restore_drops_a_cached_compute() -> None:
    metric = MeanMetric()
    _update(metric, _batches(1))
    empty = MeanMetric()
    _update(empty, _batches(1, offset=3))
    stale = empty.compute()  # cached inside the metric
    load_metric_state(empty, metric_state(metric))
    assert torch.equal(empty.compute(), metric.compute())
    assert not torch.equal(empty.compute(), stale)


def test_restored_update_count_is_the_original() -> None:
    original = MeanMetric()
    _update(original, _batches(4))
    restored = MeanMetric()
    load_metric_state(restored, metric_state(original))
    assert restored.update_count == 4


def _set_state(name: str, value: object) -> Callable[[dict], object]:
    return lambda state: state["states"].update({name: value})


@pytest.mark.parametrize(
    ("make", "corrupt", "message"),
    [
        (MeanMetric, lambda state: state["states"].pop("weight"), "the checkpoint was written for a different metric"),
        (MeanMetric, lambda state: state.pop("update_count"), "no 'update_count'"),
        (MeanMetric, lambda state: state.update(update_count=-1), "invalid update_count"),
        (MeanMetric, _set_state("weight", [torch.tensor(1.0)]), "'weight' is a list"),
        # Accumulators torchmetrics reduces element by element only grow from their default: by broadcasting,
        # by promotion (test_accumulators_that_updates_grew_from_their_default_restore_bit_exact).
        (MeanMetric, _set_state("weight", torch.tensor(2, dtype=torch.int64)),
         re.escape("'weight' is () int64 but the metric keeps () float32")),
        (lambda: MulticlassAccuracy(num_classes=NUM_CLASSES, average="macro"),
         _set_state("tp", torch.zeros(NUM_CLASSES + 3, dtype=torch.long)),
         re.escape("MulticlassAccuracy state 'tp' is (7,) int64 but the metric keeps (4,) int64 (written for another")),
        (lambda: MulticlassAccuracy(NUM_CLASSES, average="micro"), _set_state("tp", torch.zeros(0, dtype=torch.long)),
         re.escape("'tp' is (0,) int64 but the metric keeps (1,) int64")),
        (CatMetric, _set_state("value", [torch.tensor(1.0), "x"]), "'value' holds a str among its tensors"),
    ],
    ids=["missing-state", "missing-count", "negative-count", "wrong-kind", "a-dtype-it-does-not-cast-to",
         "another-num-classes", "no-elements", "a-list-of-not-tensors"],
)
def test_load_refuses_a_mismatched_snapshot_and_leaves_the_metric_alone(
    make: Callable[[], Metric], corrupt: Callable[[dict], object], message: str
) -> None:
    source = make()
    _update(source, _batches(2))
    state = metric_state(source)
    corrupt(state)
    target = make()
    _update(target, _batches(1, offset=5))
    before = metric_state(target)
    with pytest.raises(StateError, match=message):
        load_metric_state(target, state)
    assert_nested_equal(metric_state(target), before)


def _update_and_merge(metric: Metric) -> None:
    """An integer data_range (int64) that merge_state averaged: float32 (as job.elastic merges ranks' metrics)."""
    metric.update(torch.rand(2, 3, 4, 4) * 255, torch.rand(2, 3, 4, 4) * 255)
    metric.merge_state(copy.deepcopy(metric))
    assert metric.data_range.dtype == torch.float32


GROWN: dict[str, tuple[Callable[[], Metric], Callable[[Metric], object]]] = {
    "R2Score of 2-D predictions: () to (3,)": (
        lambda: R2Score(multioutput="raw_values"), lambda m: m.update(torch.rand(8, 3), torch.rand(8, 3))),
    "KLDivergence of float64: float32 to float64": (
        KLDivergence, lambda m: m.update(torch.rand(4, 5).double().softmax(-1), torch.rand(4, 5).double().softmax(-1))),
    "merged PSNR: int64 to float32": (lambda: PeakSignalNoiseRatio(data_range=(0, 255)), _update_and_merge),
}


@pytest.mark.parametrize("name", GROWN)
def test_accumulators_that_updates_grew_from_their_default_restore_bit_exact(name: str) -> None:
    """Out-of-place updates (``self.x = self.x + ...``) broadcast and promote: a checkpoint of these, written
    by the same program, was refused as another metric's for a while."""
    make, update = GROWN[name]
    original = make()
    update(original)
    restored = make()
    load_metric_state(restored, save_and_load(metric_state(original)))
    assert_nested_equal(restored.compute(), original.compute())
    assert_nested_equal(metric_state(restored), metric_state(original))


def test_as_metric_dict_normalizes_every_accepted_form() -> None:
    mean = MeanMetric()
    assert as_metric_dict(None) == {}
    assert as_metric_dict(mean) == {"MeanMetric": mean}
    assert as_metric_dict({"m": mean}) == {"m": mean}
    assert sorted(as_metric_dict(METRICS["collection"]())) == ["accuracy", "precision"]
    with pytest.raises(TypeError, match="str to torchmetrics.Metric"):
        as_metric_dict({"m": 1})  # type: ignore[dict-item]
