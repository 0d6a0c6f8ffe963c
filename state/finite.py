"""Whether a training state is still numbers. A run that diverged holds NaN or Inf in its parameters or its
optimizer's moments from then on; a checkpoint of that state would push a good one out of retention (the
newest ``--keep`` stay, locally and in the bucket) with a state nothing can train from again."""
from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

MODEL, OPTIMIZERS = "model", "optimizers"  # the keys of State.state_dict() (and of job.sharded's save tree)


def trained_tensors(tree: Mapping[str, Any], parameter_names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a state dict that training writes, by dotted name: the model's parameters (not its
    buffers, which may hold anything: an attention mask's -inf) and every optimizer's per-parameter state."""
    model, parameters = tree.get(MODEL), set(parameter_names)
    if isinstance(model, Mapping):
        for name, value in model.items():  # in the model's order: the same name every time
            if name in parameters and isinstance(value, torch.Tensor):
                yield f"{MODEL}.{name}", value
    optimizers = tree.get(OPTIMIZERS)
    if isinstance(optimizers, Mapping):
        for kind, optimizer in optimizers.items():
            per_parameter = optimizer.get("state") if isinstance(optimizer, Mapping) else None
            for key, moments in per_parameter.items() if isinstance(per_parameter, Mapping) else ():
                for moment, value in moments.items() if isinstance(moments, Mapping) else ():
                    if isinstance(value, torch.Tensor):
                        yield f"{OPTIMIZERS}.{kind}.state.{key}.{moment}", value


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating tensor holding a NaN or an Inf; None when every one is finite.

    One reading pass over each tensor and no allocation of its size: a sum is finite when every element
    is, and NaN or Inf anywhere makes it NaN or Inf. A finite tensor whose sum overflows (values near the
    float32 limit) is told apart by an exact look at that tensor only. One synchronization per device."""
    names: dict[torch.device, list[str]] = {}
    sums: dict[torch.device, list[torch.Tensor]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        local = _local(tensor)
        if not (local.is_floating_point() or local.is_complex()) or local.is_meta or local.numel() == 0:
            continue
        low = local.dtype in (torch.float16, torch.bfloat16)  # summed in float32: no overflow from their range
        total = local.sum(dtype=torch.float32) if low else local.sum()
        names.setdefault(local.device, []).append(name)
        sums.setdefault(local.device, []).append(total.abs().double() if local.is_complex() else total.double())
        tensors[name] = local
    suspects = [name for device, found in sums.items()
                for name, finite in zip(names[device], torch.isfinite(torch.stack(found)).tolist()) if not finite]
    return next((name for name in suspects if not bool(torch.isfinite(tensors[name]).all())), None)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (each rank checks its own); any other tensor as it is. Told apart
    without importing torch.distributed.tensor: until something has, no tensor can be one."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor) else tensor
