"""Building the model without its random initialisation when a checkpoint is about to overwrite it.

A resume from the bucket builds the model while the checkpoint downloads (job.app). The random
initialisation of the weights then competes for the CPU with the download and its hashing, and is
thrown away by the load: 0.14 s of CPU for 34M parameters on the benchmark machine, about 4 s per
billion parameters (BENCHMARKS.md, fifteenth and sixteenth sessions). Here the model is constructed on
the meta device (shapes only), and its parameters and buffers are allocated, uninitialised, on the
run's device. When no checkpoint is loaded after all (a first start), ``initialise`` builds the model
as a normal start does, from the same seed, and copies its weights in: the result, and the random
number generators' state after it, are those of a start that never deferred. Under torchrun every rank
defers or none (job.build), and those weights are then broadcast from rank 0, as DistributedDataParallel
did when it wrapped the model on a normal start. With ``--sharded`` (FSDP2) the model stays on the meta
device, FSDP2 shards it there, and ``allocate_shards`` allocates only this rank's shards: no device ever
holds the whole model, so job.app defers every sharded start, a first one too. ``initialise`` then gives
each rank's shards its slice of the model that rank builds on the CPU (seeded by its rank), as sharding
that model does on a normal start: no collective, the same weights.

Only a model whose state_dict holds everything it computes with can be left uninitialised: a
non-persistent buffer (a rotary cache) or a plain tensor attribute would keep garbage after the load.
That cannot be seen from outside in general, so a --model factory opts in: a class or function with
the attribute ``skip_init_on_resume = True`` (the decorator below; job.builtin's models do). A factory
that does not opt in is called once, as before. What can be seen (non-persistent buffers, tensor
attributes, lazy parameters) is still checked, and such a model is built as usual with a warning.

The data set is built after the model. A normal start builds it from the generators' state after the
model's initialisation; a deferred one from the seeded state. So job.build checks that nothing after the
model draws from the global generators, and builds again without deferring where something does.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

from job import distributed
from job.exceptions import ConfigError
from state import capture_rng, restore_rng
from state.display import clip

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

OPT_IN = "skip_init_on_resume"
Factory = TypeVar("Factory", bound=Callable[..., Any])


def skip_init_on_resume(factory: Factory) -> Factory:
    """Marks a --model factory whose models' state_dict holds everything they compute with."""
    setattr(factory, OPT_IN, True)
    return factory


def construct(factory: Callable[[], nn.Module], device: torch.device, defer: bool,
              name: str = "--model", sharded: bool = False) -> tuple[nn.Module, bool]:
    """The model on ``device``, and whether its initialisation was deferred (then its values are garbage
    until a checkpoint is loaded into it, or ``initialise`` runs). ``sharded``: a deferred model stays on
    the meta device, for FSDP2 to shard there and ``allocate_shards`` to allocate."""
    if defer and getattr(factory, OPT_IN, False) is True:
        seeded = capture_rng()  # the meta attempt's python and numpy draws are undone for the normal build
        try:
            with torch.device("meta"):
                shell = factory()
        except Exception as e:  # noqa: BLE001 - user code; the normal build below raises its real errors
            logger.warning("%s could not be built on the meta device (%s): built with its random initialisation",
                           name, clip(str(e).splitlines()[0] if str(e) else type(e).__name__, 200))
        else:
            problem = _incomplete(shell) if isinstance(shell, nn.Module) else "is not a torch.nn.Module"
            if problem is None:
                if not sharded:
                    _materialise(shell, device)
                return shell, True
            logger.warning("%s opts in to %s but its model %s: built with its random initialisation",
                           name, OPT_IN, problem)
        restore_rng(seeded)
    model = factory()
    if isinstance(model, nn.Module):
        model.to(device)
    return model, False


def rng_kept() -> Callable[[], bool]:
    """A check that no global generator (python, numpy, torch, CUDA) has been drawn from since this call."""
    before = capture_rng()
    return lambda: _same(before, capture_rng())


def initialise(model: nn.Module, factory: Callable[[], nn.Module], seed: Callable[[], None],
               name: str = "--model") -> None:
    """Give a deferred model the weights a normal start gives it: ``seed()`` (job.build's seeding), then
    the factory's random initialisation on the CPU, as a normal start does it, moved into ``model`` (the
    optimizer's parameters stay the model's; no second copy of the weights is kept)."""
    seed()
    fresh = factory()
    mine, theirs = _tensors(model), _tensors(fresh)
    differs = [key for key in mine.keys() | theirs.keys() if key not in mine or key not in theirs
               or (mine[key].shape, mine[key].dtype) != (theirs[key].shape, theirs[key].dtype)]
    if differs:
        raise ConfigError(f"{name} built two different models (they differ in {', '.join(sorted(differs)[:5])}): "
                          f"a factory that sets {OPT_IN} must build the same model each time")
    sharded = any(_is_dtensor(t) for t in mine.values())
    once: dict[int, tuple[str, torch.Tensor]] = {}  # a tied tensor once, under its first name
    for key, target in mine.items():
        once.setdefault(id(target), (key, target))
    with torch.no_grad():
        for key, target in once.values():
            if _is_dtensor(target):  # FSDP2's shard (a view of its storage): this rank's slice of its own
                # model, as fully_shard cut it, from this rank's tensor, no collective
                target.to_local().copy_(_my_slice(theirs[key].detach(), target))
            else:
                target.data = theirs[key].detach().to(target.device)
    _flatten_rnns(model)
    if not sharded:
        # Under DistributedDataParallel every rank built its own weights (seeded by its rank); the wrap, which
        # made them rank 0's on a normal start, happened while they were uninitialised.
        distributed.broadcast_tensors([target for _, target in once.values()])


def _my_slice(whole: torch.Tensor, target: DTensor) -> torch.Tensor:
    """This rank's part of ``whole`` (on the CPU) as ``target`` places it, cut on the CPU: only the part
    goes to the device (distribute_tensor would move the whole tensor there first). Placements other than
    Shard and Replicate (strided shards of FSDP over tensor parallelism) go through distribute_tensor."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    if all(type(p) in (Shard, Replicate) for p in target.placements):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        return whole[tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))]
    return distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor, without importing torch.distributed.tensor where nothing else has (it
    takes a second; job.sharded_layout): until something has imported it, no tensor can be one."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # None: not (yet) imported
    return dtensor is not None and isinstance(t, dtensor)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, tied ones under each of their names: the module's own tensors,
    not what state_dict hooks make of them."""
    return dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _incomplete(model: nn.Module) -> str | None:
    """What of ``model`` a state_dict would not restore, or None."""
    for name, module in model.named_modules():
        where = f" in {name}" if name else ""
        if module._non_persistent_buffers_set:
            return f"has non-persistent buffers{where} ({', '.join(sorted(module._non_persistent_buffers_set))})"
        own = {id(t) for t in (*module._parameters.values(), *module._buffers.values()) if t is not None}
        tensors = sorted(key for key, value in vars(module).items()
                         if key not in _MODULE_OWN and _holds_tensor(value, own))
        if tensors:
            return f"keeps tensors outside its parameters and buffers{where} ({', '.join(tensors)})"
        lazy = [key for key, t in [*module._parameters.items(), *module._buffers.items()]
                if isinstance(t, UninitializedTensorMixin)]
        if lazy:
            return f"has lazy parameters{where} ({', '.join(lazy)})"
    return None


# What every nn.Module keeps in its __dict__ (its parameters, buffers, submodules, hooks): not the model's own.
_MODULE_OWN = frozenset(vars(nn.Module()))


def _holds_tensor(value: Any, own: set[int], depth: int = 0) -> bool:
    """A tensor, or a list, tuple or dict that holds one (a few levels deep: a table of per-layer
    caches): on the meta device these stay meta tensors, which the load never replaces. Not the module's
    own parameters and buffers (``own``, by id) listed again: nn.LSTM keeps them in ``_flat_weights``."""
    if isinstance(value, torch.Tensor):
        return id(value) not in own
    if depth >= 3:
        return False
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, (list, tuple)) and any(_holds_tensor(item, own, depth + 1) for item in value)


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Allocate every parameter and buffer on ``device``, uninitialised, in the meta tensor's layout (a
    channels_last weight stays one), keeping tied ones tied.

    Not ``Module.to_empty``: its ``empty_like`` of a meta tensor goes through torch's Python reference
    implementation, whose first call imports torch.fx's symbolic shapes (0.2-0.3 s, once per process), and
    it unties tied weights.
    """
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by the meta tensor's id, kept alive with it

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            made[id(t)] = t, nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)][1]

    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False, remove_duplicate=False),
                             *module.named_buffers(recurse=False, remove_duplicate=False)]:
            setattr(module, name, empty(tensor))
    _flatten_rnns(model)


def allocate_shards(model: nn.Module, device: torch.device) -> None:
    """Allocate a model that FSDP2 sharded on the meta device: each parameter's shard of this rank, and
    the buffers, uninitialised on ``device``. FSDP2's own way (``to_empty`` after ``fully_shard``, as
    torchtitan builds): the whole model is never on the device, only this rank's part of it. Parameters
    that one FSDP group shares stay one (job.sharded.tied_groups)."""
    model.to_empty(device=device)
    _flatten_rnns(model)


def _flatten_rnns(model: nn.Module) -> None:
    """What ``Module.to`` does for recurrent layers: their weights in one chunk for cuDNN (no-op on CPU)."""
    for module in model.modules():
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
