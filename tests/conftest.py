"""Shared fixtures. Heavy helpers live in tests/support/; this file only wires them as fixtures."""
from __future__ import annotations

# --- section: tiny model and data (owner: job/state) ---
import pytest


@pytest.fixture
def tiny_config():
    """A factory for a tiny, fast TrainConfig (the built-in MLP on spirals, with dropout and grad accum)."""
    from tests.support import jobs  # imported lazily: torch-free tests must not pay for (or need) torch

    return jobs.train_config


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "checkpoints"


# --- section: S3 server and fault proxy (owner: uploader) ---
