"""Fixtures for the state package: a tiny trainable setup and a one-process gloo group."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.state.helpers import MakeSetup, build_setup


@pytest.fixture(autouse=True)
def _isolate_global_rng() -> Iterator[None]:
    """These tests seed and restore the global generators; leave them as found for everyone else's tests."""
    python, numpy_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)


@pytest.fixture
def make_setup() -> MakeSetup:
    """Factory for a realistic State (model with dropout, AdamW, StepLR, metrics) plus its data and sampler."""
    return build_setup


@pytest.fixture
def gloo_group() -> Iterator[None]:
    """A world of one over gloo on 127.0.0.1, enough to build a real DistributedDataParallel."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
