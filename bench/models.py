"""Models sized by their checkpoint, and training configs for the benchmarks.

A checkpoint of a model trained with AdamW holds the parameters and two moments: about 3 x 4 bytes
per parameter in fp32. The built-in MLP (job.builtin.MLP) is reused at widths that give round state
sizes, so the benchmarks measure the real State, optimizer and loop, just with more bytes. The
factories are plain ``--model bench.models:NAME`` plugins, usable by ``job train`` too.
"""
from __future__ import annotations

import os
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import nn

from job.builtin import MLP
from job.deferred_init import skip_init_on_resume

# --size name -> --model spec. "smoke" is the built-in tiny MLP (~0.4 MB of state).
SIZES = {
    "smoke": "mlp",
    "100MB": "bench.models:mlp_100mb",
    "200MB": "bench.models:mlp_200mb",
    "400MB": "bench.models:mlp_400mb",
    "600MB": "bench.models:mlp_600mb",
    "1GB": "bench.models:mlp_1gb",
    "mlp-large": "mlp-large",  # the built-in ~100M-parameter model: 1.2 GB of state
}
FOREVER = "1000000000ba"  # an interval or duration never reached: "no checkpoint", "no eval"


@skip_init_on_resume
def mlp_100mb() -> nn.Module:
    """8.4M parameters: 101 MB of fp32 state with AdamW."""
    return MLP(hidden=1024, depth=9)


@skip_init_on_resume
def mlp_200mb() -> nn.Module:
    """16.8M parameters: 202 MB of state."""
    return MLP(hidden=2048, depth=5)


@skip_init_on_resume
def mlp_400mb() -> nn.Module:
    """33.6M parameters: 403 MB of state."""
    return MLP(hidden=2048, depth=9)


@skip_init_on_resume
def mlp_600mb() -> nn.Module:
    """50.3M parameters: 604 MB of state (issue 19's "600 MB CPU state")."""
    return MLP(hidden=2048, depth=13)


@skip_init_on_resume
def mlp_1gb() -> nn.Module:
    """84M parameters: 1.01 GB of state."""
    return MLP(hidden=4096, depth=6)


def chosen_sizes(sizes: str, smoke: bool) -> list[str]:
    """A ``--sizes`` option (comma-separated), or only the tiny model in ``--smoke`` mode."""
    return ["smoke"] if smoke else [s.strip() for s in sizes.split(",") if s.strip()]


def model_spec(size_or_spec: str) -> str:
    """A --size name, or any --model spec passed through."""
    return SIZES.get(size_or_spec, size_or_spec)


def bench_config(model: str, max_duration: str = FOREVER, device: str = "cpu", precision: str = "fp32",
                 **overrides: Any) -> Any:
    """The tests' tiny config with the benchmark's model: no gradient accumulation, no evaluation and
    no progress logging in the way of the timings (both arms of a comparison use the same)."""
    from job.schedule import Interval
    from state import Precision
    from tests.support.jobs import train_config

    settings: dict[str, Any] = {
        "model": model_spec(model), "max_duration": max_duration, "device": device,
        "precision": Precision(precision), "grad_accum": 1, "batch_size": 64,
        "eval_interval": Interval.parse(FOREVER), "log_interval": 10 ** 9,
    }
    settings.update(overrides)
    return train_config(**settings)


def prepared_run(cfg: Any, steps: int = 3) -> Any:
    """build(cfg) and a few real optimizer steps, so the AdamW moments exist (they are 2/3 of the state)."""
    from job.build import build
    from job.loop import Trainer, to_device

    run = build(cfg)
    trainer = Trainer(run, cfg.eval_interval, cfg.log_interval, after_step=lambda state, ended: None)
    run.sampler.set_epoch(0, 0)
    for batch in islice(run.state.train_dataloader, steps):
        trainer.train_step(to_device(batch, run.device))
    if run.device.type == "cuda":
        torch.cuda.synchronize()
    return run


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """Every tensor of a state dict, depth first."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_of(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_of(v)]
    return []


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def sync_save_seconds(state: Any, path: Path) -> float:
    """The naive synchronous save a loop would block on: ``torch.save(state.state_dict())`` + flush +
    fsync into ``path`` (removed after); the reference the stall benchmarks compare against."""
    started = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed
