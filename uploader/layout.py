"""Where a checkpoint's objects live under a remote root.

    <root>/step-000000000120/<files...>        data, uploaded first
    <root>/step-000000000120/manifest.json     uploaded last: its presence makes the checkpoint complete
    <root>/step-000000000120/nodes/node-00001-of-00002.json
                                               multi-node only: one node's part, written last by that node
    <root>/latest                              {"name": ..., "step": ...}, a hint for humans and tools

Readers never trust ``latest``: it may be stale or name a pruned checkpoint. They list the root and
take manifests newest first. Names are the local ones (uploader.local.checkpoint_name), zero-padded
so that a key listing sorts like steps.
"""
from __future__ import annotations

import json
import re

from uploader.local import checkpoint_name, parse_step
from uploader.manifest import MANIFEST_NAME

LATEST_KEY = "latest"
NODES_DIR = "nodes"
_NODE_RE = re.compile(r"node-([0-9]{5})-of-([0-9]{5})\.json", re.ASCII)


def data_key(name: str, relpath: str) -> str:
    return f"{name}/{relpath}"


def manifest_key(name: str) -> str:
    return f"{name}/{MANIFEST_NAME}"


def checkpoint_of(key: str) -> tuple[str, int, str] | None:
    """(name, step, rest of the key) for a key inside a checkpoint prefix, None for anything else."""
    name, sep, rest = key.partition("/")
    step = parse_step(name)
    if step is None or not sep or not rest:
        return None
    return name, step, rest


def latest_document(step: int) -> bytes:
    return json.dumps({"name": checkpoint_name(step), "step": step}).encode()


def node_key(name: str, node: int, nodes: int) -> str:
    """Where node ``node`` of ``nodes`` puts its part's manifest (uploader.sync, "Multi-node")."""
    return f"{name}/{NODES_DIR}/node-{node:05d}-of-{nodes:05d}.json"


def parse_node_key(name: str, key: str) -> tuple[int, int] | None:
    """(node, nodes) of a key made by :func:`node_key` for checkpoint ``name``, None for any other key."""
    prefix = f"{name}/{NODES_DIR}/"
    m = _NODE_RE.fullmatch(key[len(prefix):]) if key.startswith(prefix) else None
    return (int(m.group(1)), int(m.group(2))) if m else None
