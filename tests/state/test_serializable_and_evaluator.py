"""The Serializable defaults and the Evaluator record."""

from __future__ import annotations

import pytest
from torchmetrics import MeanMetric, MetricCollection, SumMetric

from state import Evaluator, Serializable


def test_serializable_defaults_are_stateless() -> None:
    obj = Serializable()
    assert obj.state_dict() == {}
    obj.load_state_dict({"anything": 1})
    assert obj.state_dict() == {}


def test_evaluator_keeps_a_metric_dict() -> None:
    mean = MeanMetric()
    evaluator = Evaluator(label="val", dataloader=[1, 2], metrics={"mean": mean})
    assert evaluator.label == "val"
    assert evaluator.dataloader == [1, 2]
    assert evaluator.metrics == {"mean": mean}


@pytest.mark.parametrize(
    ("metrics", "names"),
    [(MeanMetric(), ["MeanMetric"]), (MetricCollection({"a": MeanMetric(), "b": SumMetric()}), ["a", "b"])],
)
def test_evaluator_normalizes_metric_and_collection(metrics: object, names: list[str]) -> None:
    evaluator = Evaluator(label="val", dataloader=[], metrics=metrics)  # type: ignore[arg-type]
    assert sorted(evaluator.metrics) == names


@pytest.mark.parametrize(("label", "metrics"), [("", {}), ("val", {"x": 3}), ("val", 3)])
def test_evaluator_rejects_bad_fields(label: str, metrics: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        Evaluator(label=label, dataloader=[], metrics=metrics)  # type: ignore[arg-type]
