"""An evaluation set: data plus the metrics computed on it, under one label."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torchmetrics

from state.metrics import as_metric_dict

logger = logging.getLogger(__name__)


@dataclass
class Evaluator:
    """One labelled evaluation; the label keys its results in ``State.current_metrics``.

    ``metrics`` may be given as a Metric or MetricCollection for convenience; it is stored as a dict so that
    callers and checkpoints see a single shape.
    """

    label: str
    dataloader: Iterable[Any]
    metrics: dict[str, torchmetrics.Metric]

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not self.label:
            raise ValueError(f"an Evaluator needs a non-empty str label, got {self.label!r}")
        self.metrics = as_metric_dict(self.metrics)
