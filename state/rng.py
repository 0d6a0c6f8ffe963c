"""Capture and restore every random number generator a training step can draw from.

A resumed run only matches an uninterrupted one if dropout masks, shuffles and augmentations draw the same
numbers, so all four generators (python, numpy, torch CPU, torch CUDA) travel in the checkpoint. The captured
dict holds only tensors, ints, floats, strings, tuples and lists, so it loads with ``weights_only=True``.
"""

from __future__ import annotations

import logging
import random
import warnings
from typing import Any

import numpy as np
import torch

from state.exceptions import StateError

logger = logging.getLogger(__name__)

SEED_LIMIT = 2**32  # numpy's legacy seeding accepts [0, 2**32); one range for all generators keeps runs comparable


def seed_all(seed: int) -> None:
    """Seed python, numpy, torch and every CUDA device from one number, so a run is defined by its seed."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}: {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def capture_rng() -> dict[str, Any]:
    """The state of every generator; drawing after :func:`restore_rng` of it repeats the draws made after now."""
    numpy_state = np.random.get_state(legacy=True)
    if not isinstance(numpy_state, tuple):  # legacy=True always gives the tuple form for the global MT19937
        raise StateError(f"numpy's global generator is not MT19937: {numpy_state!r}")
    algorithm, keys, pos, has_gauss, cached_gaussian = numpy_state
    cuda: list[torch.Tensor] = []
    if torch.cuda.is_available():
        cuda = [torch.cuda.get_rng_state(device) for device in range(torch.cuda.device_count())]
    return {
        "python": random.getstate(),
        "numpy": {
            "algorithm": str(algorithm),
            # An ndarray would need numpy's pickle globals, which weights_only loading refuses.
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put every generator back to a :func:`capture_rng` snapshot.

    CUDA states are restored for the devices both sides have; a different device count (or a checkpoint
    from a CPU-only run) only warns, because resuming on other hardware is legitimate even if not bit-exact.
    """
    missing = [key for key in ("python", "numpy", "torch") if key not in state]
    if missing:
        raise StateError(f"rng state is missing {', '.join(missing)}; was it written by capture_rng()?")
    numpy_tuple = _numpy_state(state["numpy"])
    python_state = state["python"]
    # Pickling may turn the inner tuple into a list; random.setstate insists on tuples.
    python_tuple = tuple(tuple(part) if isinstance(part, list) else part for part in python_state)

    random.setstate(python_tuple)
    np.random.set_state(numpy_tuple)
    torch.set_rng_state(state["torch"])
    _restore_cuda(state.get("cuda"))


MT19937_WORDS = 624  # the keys of numpy's legacy generator; its position runs from 0 to this many


def _numpy_state(saved: Any) -> tuple[str, np.ndarray, int, int, float]:
    """numpy's legacy ``set_state`` checks the keys' count but not the position: a ``pos`` of 625 drew from
    past the keys, one of 10**6 killed the process (SIGSEGV). Python's and torch's generators check theirs."""
    try:
        algorithm = saved["algorithm"]
        keys = np.asarray(saved["keys"], dtype=np.int64)
        pos, has_gauss, cached = int(saved["pos"]), int(saved["has_gauss"]), float(saved["cached_gaussian"])
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        raise StateError(f"rng state has an unreadable numpy entry: {error}") from error
    if (algorithm != "MT19937" or keys.shape != (MT19937_WORDS,) or keys.min() < 0 or keys.max() >= 2**32
            or not 0 <= pos <= MT19937_WORDS or has_gauss not in (0, 1) or not np.isfinite(cached)):
        raise StateError(f"rng state's numpy entry is not a MT19937 state ({MT19937_WORDS} keys of 32 bits, a "
                         f"position from 0 to {MT19937_WORDS}): algorithm {str(algorithm)[:20]!r}, "
                         f"{keys.size} keys, position {pos}")
    return algorithm, keys.astype(np.uint32), pos, has_gauss, cached


def _restore_cuda(saved: list[torch.Tensor] | None) -> None:
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved is None:
        if available:
            warnings.warn(
                "the rng checkpoint has no CUDA states; CUDA generators keep their current state",
                UserWarning,
                stacklevel=3,
            )
        return
    if not isinstance(saved, (list, tuple)) or not all(
            isinstance(one, torch.Tensor) and one.dtype == torch.uint8 for one in saved):
        # Checked on every machine: one without the devices would otherwise take any value and only warn.
        raise StateError("rng state's cuda entry is not a list of CUDA generator states (uint8 tensors)")
    if len(saved) != available:
        warnings.warn(
            f"the rng checkpoint has CUDA states for {len(saved)} device(s) but {available} are available; "
            f"restoring the first {min(len(saved), available)}, the resumed run will not be bit-exact on the rest",
            UserWarning,
            stacklevel=3,
        )
    for device in range(min(len(saved), available)):
        torch.cuda.set_rng_state(saved[device], device)
