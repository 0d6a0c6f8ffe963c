"""Sharded checkpoints for models that do not fit one device (FSDP2, ``--sharded``), on any number of ranks.

The model and the optimizers are saved and loaded by torch.distributed.checkpoint (DCP) with the state
dicts of torch.distributed.checkpoint.state_dict (keys are parameter names, values DTensors): every
rank writes its local shards, and a load reads into this run's DTensors whatever sharding they have,
DCP's planner working out which stored chunks overlap which local shard. So a checkpoint written on W
ranks resumes on W' ranks, an unsharded run's checkpoint resumes sharded (the full tensors are split
by torch's set_state_dict), and a sharded one resumes unsharded or is reassembled for `job inspect`
(DCP reading every chunk into full tensors, without a process group). The storage under DCP is
job.dcp_storage: metadata as JSON, every read weights-only.

What is not sharded stays out of DCP, in plain weights-only torch files: ``replicated.pt`` (written by
rank 0: timer, schedulers, seed, computed metrics) and one ``rank-RRRRR-of-WWWWW.pt`` per rank (its RNG
streams and metric accumulators, which job.elastic hands over on another number of ranks, and its model
buffers: job.sharded_layout.own_buffers).

A periodic save is asynchronous like an unsharded one (job.checkpoint; the durable ones, at the end
and at preemption, take the same steps from the live state, in the training thread): the training
thread copies this rank's shards into reused host buffers (:class:`HostStaging`, DCP's own staging)
and runs DCP's planning, the only part of a DCP save with collectives (job.dcp_storage.plan_save); a
background thread then writes, fsyncs and hashes the files from the copies with no collective at all.
Collectives of a save must not run on another thread beside training's own: the ranks' threads would
enter a group's collectives in different orders (an FSDP all-gather on one rank facing a checkpoint's
gather on another), which deadlocks or mixes up their data. The exchange after the writes (every
rank's results, for the coordinator's metadata and the manifest) runs back in the training thread,
after a later step (job.checkpoint).

Every rank reads the files of the chosen checkpoint from its node's folder: the whole checkpoint on one
node or a shared volume; on nodes with disks of their own, what its node downloaded (job.node_pull).
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from job import dcp_storage
from job.exceptions import CheckpointLoadError
from job.safe_load import first_line
from job.sharded_layout import MODEL, OPTIMIZERS
from state import State

def shard_model(model: torch.nn.Module, device: torch.device, world: int) -> DeviceMesh:
    """FSDP2: shard each top-level child that has parameters, then the root (one all-gather per child).

    Children that share a parameter (tied weights: a token embedding and the output layer) are sharded
    together, as one group: FSDP2 gives each group its own sharded copy of a parameter, and refused the
    tied model at its first forward ("shared with a parameter already managed by another FSDP group").
    A child sharing one with the root's own parameters is left to the root's group."""
    mesh = init_device_mesh(device.type, (world,))
    for group in tied_groups(model):
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def tied_groups(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """The top-level children with parameters, in order, those that share one in the same group."""
    children = [child for child in model.children() if any(True for _ in child.parameters())]
    group = list(range(len(children)))  # union-find over the children, by parameter identity

    def root(i: int) -> int:
        while group[i] != i:
            i = group[i]
        return i

    owner: dict[int, int] = {}
    for i, child in enumerate(children):
        for param in child.parameters():
            j = owner.setdefault(id(param), i)
            group[root(i)] = root(j)
    with_root = {root(owner[id(p)]) for p in model.parameters(recurse=False) if id(p) in owner}
    groups: dict[int, list[torch.nn.Module]] = {}
    for i, child in enumerate(children):
        if root(i) not in with_root:
            groups.setdefault(root(i), []).append(child)
    return list(groups.values())


def _optimizers(state: State) -> dict[str, torch.optim.Optimizer]:
    return {type(opt).__qualname__: opt for opt in state.optimizers}


def save_tree(state: State) -> dict[str, Any]:
    """What DCP saves of ``state``: its model and optimizer state dicts (DTensors: each rank its shards).

    An optimizer that has not stepped yet is saved as it is (its hyperparameters only): torch's
    get_optimizer_state_dict would first take a zero step to create its state, and that step would count.
    """
    return {MODEL: get_model_state_dict(state.model),
            OPTIMIZERS: {name: get_optimizer_state_dict(state.model, opt) if opt.state else opt.state_dict()
                         for name, opt in _optimizers(state).items()}}


class HostStaging:
    """Host copies of a :func:`save_tree`, in buffers reused from one save to the next: what an
    asynchronous save writes from while training changes the live tensors.

    DCP's own staging (torch.distributed.checkpoint.staging.BlockingAsyncStager with its cache):
    _create_cpu_state_dict allocates once, _copy_state_dict copies into it. A DTensor stays a DTensor
    of the same mesh and placements around a host copy of its local shard, so DCP plans and writes the
    copy exactly as it would the live state; non-tensor leaves come back in fresh containers (the
    optimizer's param_groups are not the live dicts a scheduler edits). On CUDA the buffers are pinned
    and the copies asynchronous: the writer synchronizes the returned event before reading.
    """

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._buffers: dict[str, Any] | None = None
        self._layout: list[tuple[Any, ...]] | None = None

    def stage(self, tree: dict[str, Any]) -> tuple[dict[str, Any], torch.cuda.Event | None]:
        """Copy ``tree`` into the buffers (made anew when its layout changed: an optimizer's first step)."""
        layout = _layout(tree)
        if self._buffers is None or layout != self._layout:
            self._buffers = _own_copies(_create_cpu_state_dict(tree, pin_memory=self.pin_memory), tree)
            self._layout = layout
        staged = _copy_state_dict(tree, self._buffers, non_blocking=self.pin_memory, type_check=False)
        event = None
        if self.pin_memory:
            event = torch.cuda.Event()
            event.record()
        return staged, event


def _layout(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Where ``node``'s tensors are and what they hold: the buffers fit another tree of the same layout."""
    if isinstance(node, DTensor):
        local = node.to_local()
        return [(path, "dtensor", tuple(node.shape), tuple(local.shape), local.dtype, tuple(node.placements))]
    if isinstance(node, torch.Tensor):
        return [(path, "tensor", tuple(node.shape), node.dtype)]
    if isinstance(node, dict):
        return [entry for k, v in node.items() for entry in _layout(v, (*path, k))]
    if isinstance(node, (list, tuple)):
        return [entry for i, v in enumerate(node) for entry in _layout(v, (*path, i))]
    return [(path,)]


def _own_copies(buffers: Any, live: Any) -> Any:
    """``buffers`` with no tensor of ``live`` in it: _create_cpu_state_dict keeps a 0-dim DTensor as it is
    (the live one), which the copies would then leave to change under the writer."""
    if isinstance(buffers, torch.Tensor):
        return copy.deepcopy(live.detach()) if buffers is live else buffers
    if isinstance(buffers, dict):
        return {k: _own_copies(v, live[k]) for k, v in buffers.items()}
    if isinstance(buffers, (list, tuple)):
        return type(buffers)(_own_copies(b, x) for b, x in zip(buffers, live))
    return buffers


def _has_state(metadata: Metadata, name: str) -> bool:
    """Whether the checkpoint holds optimizer ``name``'s per-parameter state (it had stepped)."""
    prefix = (OPTIMIZERS, name, "state")
    return any(tuple(path[:3]) == prefix for path in metadata.planner_data.values())


def load_targets(state: State, metadata: Metadata) -> dict[str, Any]:
    """What a load of the checkpoint ``metadata`` describes fills on this rank: this run's model and
    optimizer state dicts (DTensors of this run's sharding), as DCP's load planner takes them."""
    targets: dict[str, Any] = {}
    saved = {tuple(path) for path in metadata.planner_data.values()}
    for name, opt in _optimizers(state).items():
        # A target needs the optimizer's state to exist: get_optimizer_state_dict creates it (a zero step),
        # which the load then overwrites; one saved before its first step loads its hyperparameters only.
        if not _has_state(metadata, name):
            targets[name] = opt.state_dict()
            continue
        target = get_optimizer_state_dict(state.model, opt)
        # The zero step gives every parameter state, also one that never had a gradient (a child its forward
        # does not use), which AdamW kept none for and the checkpoint holds none of: DCP refused the load as
        # "Missing key". Such a parameter is left out, and keeps no state after the load, as before the save.
        target["state"] = {fqn: entries for fqn, entries in target["state"].items()
                           if any((OPTIMIZERS, name, "state", fqn, key) in saved for key in entries)}
        targets[name] = target
    return {MODEL: get_model_state_dict(state.model), OPTIMIZERS: targets}


def files_read(state: State, folder: Path, metadata: Metadata) -> set[str]:
    """The data files a load on this rank reads: DCP's own load planner, asked for this rank's local plan
    (which stored chunks overlap this rank's shards), without loading anything and without collectives."""
    planner = dcp_storage.SafeLoadPlanner()
    try:
        planner.set_up_planner(load_targets(state, metadata), metadata, is_coordinator=False)
        plan = planner.create_local_plan()
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        raise _does_not_fit(folder, e) from None
    return {metadata.storage_data[item.storage_index].file for item in plan.items}


def load_resharded(state: State, folder: Path, metadata: Metadata) -> dict[str, Any]:
    """Collective: load a sharded checkpoint's model and optimizers into ``state`` on this run's ranks,
    whatever their number and whether the model is sharded or not (DCP reshards).

    Returns ``state``'s own model and optimizer state dicts as a State entry, to stand in for them when
    State.load_state_dict restores the rest of the checkpoint.
    """
    tree = dcp_storage.load(load_targets(state, metadata), folder, metadata)
    try:
        set_model_state_dict(state.model, tree[MODEL])
        for name, opt in _optimizers(state).items():
            if _has_state(metadata, name):
                # strict=False lets a parameter without state (see load_targets) keep none; it relaxes nothing else
                set_optimizer_state_dict(state.model, opt, tree[OPTIMIZERS][name],
                                         options=StateDictOptions(strict=False))
            else:
                opt.load_state_dict(tree[OPTIMIZERS][name])
    except (KeyError, RuntimeError, ValueError, TypeError) as e:
        raise _does_not_fit(folder, e) from None
    return _live(state)


def load_full_state(state: State, tree: dict[str, Any], source: str) -> dict[str, Any]:
    """Every rank of a sharded run: a full state (an unsharded checkpoint's ``state.pt``, read by every
    rank) into the sharded model and optimizers, each rank keeping its shard (torch's set_state_dict
    with full_state_dict). Returns ``tree`` with the model and optimizers standing in as in
    :func:`load_resharded`."""
    full = StateDictOptions(full_state_dict=True)
    saved = tree.get(OPTIMIZERS) or {}
    try:
        set_model_state_dict(state.model, tree[MODEL], options=full)
        for name, opt in _optimizers(state).items():
            osd = saved[name]
            if osd.get("state"):
                set_optimizer_state_dict(state.model, opt, by_fqn(osd, state.model, opt), options=full)
            else:  # saved before its first step: hyperparameters only (see save)
                opt.load_state_dict(osd)
    except (KeyError, RuntimeError, ValueError, TypeError, AttributeError) as e:
        raise _does_not_fit(Path(source), e) from None
    return {**tree, **_live(state)}


def full_tree(folder: Path, metadata: Metadata, keys: Iterable[str] = (MODEL, OPTIMIZERS)) -> dict[str, Any]:
    """The checkpoint's ``keys`` as full tensors, in ``state.pt``'s layout (optimizer state keyed by
    parameter index), read by this process alone: DCP reassembles every tensor from its chunks."""
    keys = tuple(keys)
    roots = {path[0] for path in metadata.planner_data.values()}
    if MODEL not in roots:
        raise CheckpointLoadError(f"{folder}: the sharded checkpoint holds no model")
    tree = dcp_storage.load({}, folder, metadata, fill=[k for k in keys if k in roots], no_dist=True)
    if OPTIMIZERS in tree:
        try:
            tree[OPTIMIZERS] = {name: by_id(osd) for name, osd in tree[OPTIMIZERS].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise CheckpointLoadError(f"{folder}: its optimizer state is malformed ({first_line(e)})") from None
    return tree


def by_id(osd: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (torch.distributed.checkpoint.state_dict) keyed by
    parameter index instead, as ``Optimizer.state_dict`` numbers them: in the order of the param groups."""
    groups = osd.get("param_groups", [])
    names = [name for group in groups for name in group["params"]]
    if all(isinstance(n, int) for n in names):
        return {"state": osd.get("state", {}), "param_groups": groups}
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in osd.get("state", {}).items()},
            "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in groups]}


def by_fqn(osd: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The inverse of :func:`by_id` for ``opt`` of ``model``: index i is the i-th parameter of its param
    groups, named as torch's get_optimizer_state_dict names it."""
    own_ids = [i for group in opt.state_dict()["param_groups"] for i in group["params"]]
    own_names = [n for group in get_optimizer_state_dict(model, opt)["param_groups"] for n in group["params"]]
    name = dict(zip(own_ids, own_names, strict=True))
    return {"state": {name[i]: value for i, value in osd["state"].items()},
            "param_groups": [{**group, "params": [name[i] for i in group["params"]]} for group in osd["param_groups"]]}


def _live(state: State) -> dict[str, Any]:
    """This run's model and optimizer state dicts, already loaded, as State.state_dict() gives them."""
    live = state.state_dict()
    return {MODEL: live[MODEL], OPTIMIZERS: live[OPTIMIZERS]}


def _does_not_fit(source: Path, e: BaseException) -> CheckpointLoadError:
    return CheckpointLoadError(
        f"checkpoint {source} does not fit this model/optimizer ({first_line(e, 300)}); resume it with the --model "
        "it was written with, or start a new run in another --save-folder/--remote")
