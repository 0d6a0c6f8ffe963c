"""What the training loop needs to know about a batch: its size, its micro-batches, its move to the device.

A batch is whatever the DataLoader collates, which the job does not choose: torch's ``default_collate`` makes
tensors, lists, tuples, dicts and namedtuples of them, and a *batch-dim list* of any field it cannot stack (a
string id per sample: ``["sample-17", ...]``). Gradient accumulation cuts every one of these along the batch
dimension; it is forced on by a resume on fewer ranks (job.elastic), so a batch that cannot be cut is
refused at the first batch with one line (ConfigError, exit 2), never with a traceback on every restart.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from job.exceptions import ConfigError
from state.display import brief

COLLATE = ("the DataLoader must yield tensors, or lists, tuples, dicts or namedtuples of them and of lists with "
           "one entry per sample, as torch's default_collate makes")


def _structure(batch: Any) -> bool:
    """Containers whose entries are fields of the batch (not samples): walked into."""
    return isinstance(batch, (list, tuple, Mapping))


def _per_sample(batch: Any) -> bool:
    """A batch-dim list: one plain value (str, int, float, ...) per sample, as default_collate leaves strings."""
    return isinstance(batch, (list, tuple)) and not any(isinstance(b, torch.Tensor) or _structure(b) for b in batch)


def _rebuild(like: Any, fields: Any) -> Any:
    """A list, tuple or namedtuple of ``fields``, of the type of ``like`` (a namedtuple takes them positionally)."""
    return type(like)(*fields) if hasattr(like, "_fields") else type(like)(fields)


def to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor of the batch moved to ``device``; the rest as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return _rebuild(batch, [to_device(b, device) for b in batch])
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def _sizes(batch: Any) -> Iterator[int]:
    """Each batch dimension in the batch, depth first: a tensor's first one, a batch-dim list's length."""
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        yield batch.shape[0]
    elif _per_sample(batch):
        yield len(batch)
    elif _structure(batch):
        for b in batch.values() if isinstance(batch, Mapping) else batch:
            yield from _sizes(b)


def batch_size(batch: Any) -> int:
    """Samples in the batch: the first tensor's first dimension, or the first batch-dim list's length.
    ConfigError where the batch has neither (the job counts samples for --max-duration and the logs)."""
    for size in _sizes(batch):
        return int(size)
    raise ConfigError(f"cannot find the batch size of a batch of type {type(batch).__name__}: {COLLATE}")


def split(batch: Any, parts: int) -> list[Any]:
    """Micro-batches for gradient accumulation: the batch cut along its batch dimension into ``parts`` pieces,
    as ``Tensor.chunk`` cuts (``ceil(n / parts)`` samples each), every field alike. ConfigError for a field that
    has no batch dimension to cut."""
    if parts == 1:
        return [batch]
    return _cut(batch, -(-batch_size(batch) // parts))


def _cut(part: Any, size: int) -> list[Any]:
    """``part`` (the batch or one of its fields) in pieces of ``size`` samples."""
    if isinstance(part, torch.Tensor) and part.dim() > 0:
        return list(part.split(size))
    if _per_sample(part):
        return [part[i:i + size] for i in range(0, len(part), size)]
    if isinstance(part, (list, tuple)):
        return [_rebuild(part, p) for p in zip(*(_cut(b, size) for b in part))]
    if isinstance(part, Mapping):
        cols = {k: _cut(v, size) for k, v in part.items()}
        return [dict(zip(cols, p)) for p in zip(*cols.values())]
    raise ConfigError(f"cannot split a batch for gradient accumulation (a resume on fewer ranks, or --grad-accum "
                      f"above 1): its field of type {type(part).__name__} ({brief(part, 40)}) has no batch dimension; "
                      f"{COLLATE}")
