"""Whether a training state is still numbers. A run that diverged holds NaN or Inf in its parameters or its
optimizer's moments from then on, or (float16 mixed precision) a loss scale that backed off to 0, from which
every step overflows; a checkpoint of that state would push a good one out of retention (the newest
``--keep`` stay, locally and in the bucket) with a state nothing can train from again."""
from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The keys of State.state_dict() (and of job.sharded's save tree, beside its replicated file's).
MODEL, OPTIMIZERS, SCALER = "model", "optimizers", "scaler"


def parameter_keys(model_state: Mapping[str, Any], model: torch.nn.Module) -> set[str]:
    """The keys of a model state dict (State.state_dict()'s, or DCP's when sharded) whose tensors are the
    trainable parameters of ``model``. Matched by storage, not by name: wrappers rename keys (DDP's prefix,
    checkpoint_wrapper's, torch.compile's under DCP), and a name missed would be a parameter never checked.
    Not the buffers (an attention mask holds -inf by design), nor frozen parameters: training writes neither.
    Of the live state dict, before any copy (a copy has storage of its own)."""
    local = _localizer()
    trained = {_storage(local(p)) for p in model.parameters() if p.requires_grad} - {None}
    return {key for key, value in model_state.items()
            if isinstance(value, torch.Tensor) and _storage(local(value)) in trained}


def trained_tensors(tree: Mapping[str, Any], parameters: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a state dict that training writes, by dotted name, in the model's order: the model's
    ``parameters`` (parameter_keys) and every optimizer's per-parameter state."""
    model, wanted = tree.get(MODEL), set(parameters)
    if isinstance(model, Mapping):
        for name, value in model.items():
            if name in wanted and isinstance(value, torch.Tensor):
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
    float32 limit) is told apart by an exact look at that tensor only. Types narrower than float32 (float16,
    bfloat16, float8) are summed in float32. One synchronization per device. A tensor torch cannot sum (a
    subclass) is skipped with a warning: never a crash, nor a healthy run refused."""
    names: dict[torch.device, list[str]] = {}
    sums: dict[torch.device, list[torch.Tensor]] = {}
    tensors: dict[str, torch.Tensor] = {}
    to_local = _localizer()
    for name, tensor in named:
        local = to_local(tensor)
        if not (local.is_floating_point() or local.is_complex()) or local.is_meta or local.numel() == 0:
            continue
        try:
            total = local.sum(dtype=torch.float32) if _narrow(local) else local.sum()
            total = total.abs().double() if total.is_complex() else total.double()
        except (RuntimeError, TypeError, NotImplementedError) as e:
            logger.warning("%s (%s) was not checked for NaN or Inf: %s", name, local.dtype, str(e).splitlines()[0])
            continue
        names.setdefault(total.device, []).append(name)
        sums.setdefault(total.device, []).append(total)
        tensors[name] = local
    suspects = [name for device, found in sums.items()
                for name, finite in zip(names[device], torch.isfinite(torch.stack(found)).tolist()) if not finite]
    return next((name for name in suspects if not _all_finite(tensors[name])), None)


def collapsed_loss_scale(tree: Mapping[str, Any]) -> tuple[str, float] | None:
    """The gradient scaler whose scale backed off to 0 (float32 underflows after about 166 overflowing steps
    in a row) or is no longer a finite positive number, with that scale: from it every step overflows and is
    skipped, so the weights stay finite and only the scale tells. None for every other state."""
    scalers = tree.get(SCALER)
    for kind, saved in scalers.items() if isinstance(scalers, Mapping) else ():
        scale = saved.get("scale") if isinstance(saved, Mapping) else None
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:
            scale = scale.item()
        if isinstance(scale, (int, float)) and not isinstance(scale, bool) and not (0 < scale < math.inf):
            return str(kind), float(scale)
    return None


def _narrow(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.element_size() < 4


def _all_finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor.float() if _narrow(tensor) else tensor).all())  # float8 has no isfinite


def _storage(local: torch.Tensor) -> tuple[torch.device, int] | None:
    return None if local.is_meta or local.numel() == 0 else (local.device, local.data_ptr())


def _localizer() -> Callable[[torch.Tensor], torch.Tensor]:
    """A DTensor's shard on this rank (each rank checks its own); any other tensor as it is. Told apart
    without importing torch.distributed.tensor: until something has, no tensor can be one."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return lambda tensor: tensor
    return lambda tensor: tensor.to_local() if isinstance(tensor, dtensor) else tensor
