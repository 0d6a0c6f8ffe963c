"""Sharded checkpoints for models that do not fit one device (FSDP2, ``--sharded``).

Each rank writes its own shard (its local pieces of every DTensor, plus its own RNG and metric
state) into one staging folder; rank 0 gathers every shard's size and sha256 and commits the
manifest only when all shards are written. The shard files are plain ``torch.save`` trees of tensors
and lists, loaded with ``weights_only=True``; a DTensor is stored as its local tensor plus its
placements, global shape and stride, and rebuilt on the same mesh at load. This avoids
torch.distributed.checkpoint, whose metadata file is unpickled as code.

The staging folder must be visible to every rank (one node, or a volume shared by the nodes).
Resuming needs the same world size; then it is exact.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

DTENSOR = "__dtensor__"


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.pt"


def shard_model(model: torch.nn.Module, device: torch.device, world: int) -> DeviceMesh:
    """FSDP2: shard each top-level child that has parameters, then the root (one all-gather per child)."""
    mesh = init_device_mesh(device.type, (world,))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def encode(tree: Any) -> Any:
    """Replace every DTensor by its local shard and how to rebuild it (plain, weights_only-safe data)."""
    if isinstance(tree, DTensor):
        placements = [["shard", p.dim] if isinstance(p, Shard) else ["replicate"] for p in tree.placements]
        return {DTENSOR: tree.to_local(), "placements": placements, "shape": list(tree.shape),
                "stride": list(tree.stride())}
    if isinstance(tree, dict):
        return {k: encode(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(encode(v) for v in tree)
    return tree


def _placements(spec: list[list[Any]]) -> list[Shard | Replicate]:
    out: list[Shard | Replicate] = []
    for item in spec:
        if item[0] == "shard":
            out.append(Shard(int(item[1])))
        elif item[0] == "replicate":
            out.append(Replicate())
        else:
            raise ValueError(f"unknown placement {item!r}")
    return out


def decode(tree: Any, mesh: DeviceMesh) -> Any:
    """Rebuild the DTensors of an encoded tree on this run's mesh."""
    if isinstance(tree, dict) and DTENSOR in tree:
        return DTensor.from_local(tree[DTENSOR].to(mesh.device_type), mesh, _placements(tree["placements"]),
                                  run_check=False, shape=torch.Size(tree["shape"]), stride=tuple(tree["stride"]))
    if isinstance(tree, dict):
        return {k: decode(v, mesh) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(decode(v, mesh) for v in tree)
    return tree


def gather_full(shards: list[Any]) -> Any:
    """The unsharded tree from every rank's encoded shard, in rank order (for `job inspect`)."""
    first = shards[0]
    if isinstance(first, dict) and DTENSOR in first:
        spec = first["placements"]
        if len(spec) != 1:
            raise ValueError("only one-dimensional meshes can be reassembled")
        if spec[0][0] == "replicate":
            return first[DTENSOR]
        return torch.cat([s[DTENSOR] for s in shards], dim=int(spec[0][1])).reshape(first["shape"])
    if isinstance(first, dict):
        return {k: gather_full([s[k] for s in shards]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(gather_full([s[i] for s in shards]) for i in range(len(first)))
    return first


def shard_files(folder: Path, world: int) -> list[Path]:
    return [folder / shard_name(r, world) for r in range(world)]
