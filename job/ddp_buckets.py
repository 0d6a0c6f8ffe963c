"""DistributedDataParallel's gradient buckets settled before the first step of each life, so that a resume on
3 or more ranks is bit-exact.

Why: DDP all-reduces the gradients of a life's first step in its initial layout, records the order in which
that backward made the gradients ready, and from the next forward on all-reduces in buckets regrouped in
that order. A ring all-reduce over 3 or more ranks adds each value in an order that depends on where it sits
in its bucket, so a resumed life's first step (initial layout) rounded differently from the uninterrupted
run's same step (regrouped): about 1e-8 per resume, measured with the built-in model on 3 CPU ranks. On 2
ranks a sum of two is the same in any order, so nothing is done there.

So each life on 3 or more ranks begins with one throwaway training-mode forward and backward of its first
micro-batch, synchronised, whose gradients are dropped: every step of every life, the first included, then
all-reduces in the regrouped layout, the same in every life for a model whose graph does not depend on its
data. It is a training forward, so every parameter a training step uses gets its gradient (eval mode would
leave a training-only head without one, and DDP then fails the next step: review 51). Nothing it changes
is kept: every random generator (python, numpy, torch, CUDA) and every buffer (batch-norm statistics) is put
back as it was, and the optimizer, the metrics and the data never see it. What a model does in forward
beyond its tensors (counting or logging what it trains on) happens once more; such a model asks
:func:`warming_up` and skips it. It costs one forward and backward per start (BENCHMARKS.md, twenty-ninth
session), and a copy of the buffers meanwhile. A model that writes its parameters in forward must do so
repeatably (``nn.Embedding(max_norm=...)`` does: the rows it scales end below the limit).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from state import State, capture_rng, restore_rng

logger = logging.getLogger(__name__)

ORDER_MATTERS_FROM = 3  # ranks: from here a ring all-reduce's sum depends on where a value sits in its bucket

_warming_up = False


def warming_up() -> bool:
    """True while the forward and backward running are this module's warm-up, not a training step: for a
    model that records what it trains on, or counts its steps, in forward."""
    return _warming_up


def settle(model: torch.nn.Module, state: State, micro: Any, world_size: int) -> None:
    """One discarded, synchronised forward and backward of ``micro`` under DDP on 3 or more ranks; nothing
    otherwise. ``model`` is in training mode (Trainer.train_step)."""
    global _warming_up
    if (not isinstance(model, DistributedDataParallel) or world_size < ORDER_MATTERS_FROM
            or not model.require_backward_grad_sync):
        return
    core = model.module
    generators = capture_rng()
    # By the tensor, not by position: a forward that registers a buffer (a mask, a longer rotary cache) keeps it,
    # as the real forward would make it again.
    buffers = [(b, b.detach().clone()) for b in core.buffers()]
    _warming_up = True
    try:
        state.batch = micro  # as Trainer.train_step sets it before each forward
        with state.precision_context:
            loss = core.loss(model(micro), micro)
        loss.backward()
    finally:
        _warming_up = False
        for p in core.parameters():
            p.grad = None
        with torch.no_grad():
            for buffer, before in buffers:
                buffer.copy_(before)
        restore_rng(generators)
