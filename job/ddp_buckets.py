"""DistributedDataParallel's gradient buckets settled before the first step of each life, so that a resume on
3 or more ranks is bit-exact.

Why: DDP all-reduces the gradients of a life's first step in its initial layout (every parameter in one bucket,
in the order the model lists them), records the order in which that backward made the gradients ready, and
from the next forward on all-reduces in buckets regrouped in that order. A ring all-reduce over 3 or more
ranks adds each value in an order that depends on where it sits in its bucket, so a resumed life's first step
(initial layout) rounded differently from the uninterrupted run's same step (regrouped): about 1e-8 per
resume, measured with the built-in model on 3 CPU ranks. On 2 ranks a sum of two is the same either way.

So each life begins with one throwaway forward and backward of its first micro-batch, synchronised, whose
gradients are dropped: every step of every life, the first included, then all-reduces in the regrouped
layout (the same in every life: the order comes from the model's graph, not from the batch's values). It
must change nothing else, so it runs in eval mode, where dropout draws nothing, batch norm updates no
statistics, and a model's own training-only bookkeeping (tests.support.recording_model) is skipped; the RNG
streams and the buffers are put back as they were all the same, and the optimizer, the metrics and the data
never see it. It costs one forward and backward per start. A model that writes its parameters in forward
writes them once more here: ``nn.Embedding(max_norm=...)`` gives the same weights when its renormalisation
runs twice (the rows it scales end below the limit), a model's own write must be as repeatable to stay
bit-exact.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from state import State

logger = logging.getLogger(__name__)


def settle(model: torch.nn.Module, state: State, micro: Any) -> None:
    """One discarded, synchronised forward and backward of ``micro`` under DDP; nothing otherwise."""
    if not isinstance(model, DistributedDataParallel) or not model.require_backward_grad_sync:
        return
    core = model.module
    devices = [p.device for p in core.parameters() if p.device.type == "cuda"][:1]
    rng = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]
    buffers = [b.detach().clone() for b in core.buffers()]
    model.eval()
    try:
        with state.precision_context:
            loss = core.loss(model(micro), micro)
        loss.backward()
    finally:
        model.train()
    for p in core.parameters():
        p.grad = None
    with torch.no_grad():
        for buffer, before in zip(core.buffers(), buffers):
            buffer.copy_(before)
    torch.set_rng_state(rng[0])
    for device, saved in zip(devices, rng[1]):
        torch.cuda.set_rng_state(saved, device)
