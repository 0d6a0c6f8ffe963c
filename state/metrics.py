"""Exact save and restore of torchmetrics accumulators.

``Metric.state_dict()`` is not enough for resuming: metric states are non-persistent by default (so they are
silently left out) and ``_update_count`` is never included, which changes both ``compute()`` (it warns, and
some metrics average by it) and the behaviour of later ``update()`` calls. These helpers capture all of it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.utilities.data import dim_zero_max, dim_zero_mean, dim_zero_min, dim_zero_sum

from state.display import brief
from state.exceptions import StateError

logger = logging.getLogger(__name__)

MetricsLike = Metric | MetricCollection | Mapping[str, Metric] | None

# States torchmetrics reduces across ranks element by element (``torch.stack`` of every rank's value, then
# sum, mean, max or min): accumulators that start as the metric's default and grow from it by arithmetic.
_ELEMENTWISE = (dim_zero_sum, dim_zero_mean, dim_zero_max, dim_zero_min)


def as_metric_dict(metrics: MetricsLike) -> dict[str, Metric]:
    """Normalize the forms users pass into one ``{name: Metric}`` dict, the shape checkpoints are keyed by.

    A MetricCollection is unpacked into its member metrics; its compute groups are materialized as copies so
    that every member holds its own, complete state (update the metrics through the returned dict).
    """
    if metrics is None:
        return {}
    if isinstance(metrics, MetricCollection):
        return dict(metrics.items(keep_base=True, copy_state=True))
    if isinstance(metrics, Metric):
        return {type(metrics).__name__: metrics}
    if isinstance(metrics, Mapping):
        result: dict[str, Metric] = {}
        for name, metric in metrics.items():
            if not isinstance(name, str) or not isinstance(metric, Metric):
                raise TypeError(f"metrics must map str to torchmetrics.Metric, got {name!r}: {type(metric).__name__}")
            result[name] = metric
        return result
    raise TypeError(
        f"metrics must be a torchmetrics Metric, MetricCollection or dict of Metrics, got {type(metrics).__name__}"
    )


def metric_state(metric: Metric | MetricCollection) -> dict[str, Any]:
    """Snapshot ``metric`` as ``{"states": {name: tensor | [tensor]}, "update_count": int}``.

    Tensors are cloned so the snapshot does not change as training continues. For a MetricCollection the
    result is ``{"metrics": {name: <snapshot of that member>}}``.
    """
    if isinstance(metric, MetricCollection):
        return {"metrics": {name: metric_state(member) for name, member in as_metric_dict(metric).items()}}
    if not isinstance(metric, Metric):
        raise TypeError(f"metric_state needs a torchmetrics Metric, got {type(metric).__name__}")
    states: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for name in metric._defaults:
        value = getattr(metric, name)
        if isinstance(value, torch.Tensor):
            states[name] = value.detach().clone()
        else:
            states[name] = [item.detach().clone() for item in value]
    return {"states": states, "update_count": int(metric._update_count)}


def load_metric_state(metric: Metric | MetricCollection, state: Mapping[str, Any]) -> None:
    """Restore a :func:`metric_state` snapshot so ``compute()`` and later ``update()`` match bit for bit.

    The snapshot must come from a metric of the same kind: a different set of state names means another
    metric (or another torchmetrics version), and guessing would resume with silently wrong numbers.
    """
    if isinstance(metric, MetricCollection):
        members = as_metric_dict(metric)
        saved = _require(state, "metrics", "metric collection")
        unknown = sorted(set(members) ^ set(saved))
        if unknown:
            raise StateError(f"metric collection state does not match the collection: differing names {unknown}")
        for name, member in members.items():
            load_metric_state(member, saved[name])
        return
    if not isinstance(metric, Metric):
        raise TypeError(f"load_metric_state needs a torchmetrics Metric, got {type(metric).__name__}")
    label = type(metric).__name__
    saved_states = _require(state, "states", label)
    update_count = _require(state, "update_count", label)
    if not isinstance(update_count, int) or isinstance(update_count, bool) or update_count < 0:
        raise StateError(f"{label} state has an invalid update_count {brief(update_count, 40)}")
    expected = set(metric._defaults)
    if set(saved_states) != expected:
        raise StateError(
            f"{label} state holds {sorted(saved_states)} but the metric has {sorted(expected)}; "
            "the checkpoint was written for a different metric"
        )
    restored: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for name in sorted(expected):
        default = metric._defaults[name]
        value = saved_states[name]
        if isinstance(default, torch.Tensor) and isinstance(value, torch.Tensor):
            if metric._reductions[name] in _ELEMENTWISE:
                _require_grown_from(value, default, f"{label} state {name!r}")
            restored[name] = value.detach().clone().to(metric.device)
        elif isinstance(default, list) and isinstance(value, (list, tuple)):
            odd = next((item for item in value if not isinstance(item, torch.Tensor)), None)
            if odd is not None:
                raise StateError(f"{label} state {name!r} holds a {type(odd).__name__} among its tensors")
            restored[name] = [item.detach().clone().to(metric.device) for item in value]
        else:
            raise StateError(
                f"{label} state {name!r} is a {type(value).__name__} but the metric keeps a {type(default).__name__}"
            )
    # Assign only after everything validated, so a bad snapshot leaves the metric as it was.
    for name, value in restored.items():
        setattr(metric, name, value)
    metric._update_count = update_count
    metric._computed = None  # a cached compute() of the pre-restore state must not be returned
    metric._forward_cache = None


def _require_grown_from(value: torch.Tensor, default: torch.Tensor, what: str) -> None:
    """An accumulator must be one its default could have become. Updates may broadcast it to a larger
    shape (R2Score's sums of 2-D predictions) and promote its dtype (float64 inputs; merge_state's means
    of an integer state), so the saved one may differ from the default as far as that; a shape the
    default does not broadcast to (a metric with another ``num_classes``), no elements, or a dtype the
    default does not cast to (bool for int64) was written for another metric or is damaged. Taken as it
    was, it trained on: the next updates failed mid-run, or the metric reported numbers from nonsense."""
    try:
        grown = torch.broadcast_shapes(default.shape, value.shape) == value.shape and value.numel() >= default.numel()
    except RuntimeError:
        grown = False
    if not grown or not torch.can_cast(default.dtype, value.dtype):
        raise StateError(
            f"{what} is {_describe_tensor(value)} but the metric keeps {_describe_tensor(default)} "
            "(written for another configuration of the metric)"
        )


def _describe_tensor(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _require(state: Mapping[str, Any], key: str, label: str) -> Any:
    if not isinstance(state, Mapping) or key not in state:
        raise StateError(f"{label} state has no {key!r}; was it written by metric_state()?")
    return state[key]
