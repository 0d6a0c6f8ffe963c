"""capture_rng / restore_rng / seed_all: a restored generator repeats the draws made after the capture."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from state import StateError, capture_rng, restore_rng, seed_all
from tests.state.helpers import save_and_load


def _draw() -> dict[str, Any]:
    return {
        "python": [random.random() for _ in range(3)],
        "numpy": np.random.rand(3).tolist() + [np.random.randn()],
        "torch": torch.rand(3),
    }


def _assert_same_draws(left: dict[str, Any], right: dict[str, Any]) -> None:
    assert left["python"] == right["python"]
    assert left["numpy"] == right["numpy"]
    assert torch.equal(left["torch"], right["torch"])


@pytest.mark.parametrize("through_checkpoint", [False, True], ids=["in-memory", "weights-only-checkpoint"])
def test_restore_repeats_the_draws_after_capture(through_checkpoint: bool) -> None:
    seed_all(3)
    np.random.randn()  # leave a cached gaussian in numpy's state, which must survive too
    captured = capture_rng()
    expected = _draw()
    _draw()  # move every generator on
    restore_rng(save_and_load(captured) if through_checkpoint else captured)
    _assert_same_draws(_draw(), expected)


def test_capture_holds_no_numpy_arrays_and_has_no_cuda_on_cpu() -> None:
    captured = capture_rng()
    assert set(captured) == {"python", "numpy", "torch", "cuda"}
    assert isinstance(captured["numpy"]["keys"], torch.Tensor)
    assert captured["cuda"] == []

    def walk(value: Any) -> None:
        assert not isinstance(value, np.ndarray) and not isinstance(value, np.generic), type(value)
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(captured)


def test_seed_all_makes_every_generator_reproducible() -> None:
    seed_all(11)
    first = _draw()
    seed_all(11)
    _assert_same_draws(_draw(), first)
    seed_all(12)
    assert _draw()["python"] != first["python"]


@pytest.mark.parametrize(("seed", "error"), [(-1, ValueError), (2**32, ValueError), (1.0, TypeError)])
def test_seed_all_validates(seed: object, error: type) -> None:
    with pytest.raises(error):
        seed_all(seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("missing", ["python", "numpy", "torch"])
def test_restore_refuses_a_state_missing_a_generator(missing: str) -> None:
    captured = capture_rng()
    del captured[missing]
    with pytest.raises(StateError, match=f"missing {missing}"):
        restore_rng(captured)


@pytest.mark.parametrize(("entry", "value"), [
    ("pos", 10**6), ("pos", 625), ("pos", -1), ("keys", torch.zeros(10, dtype=torch.int64)),
    ("keys", torch.full((624,), 2**32)), ("algorithm", "PCG64"), ("has_gauss", 2), ("cached_gaussian", float("nan")),
])
def test_restore_refuses_a_numpy_state_its_generator_would_read_past(entry: str, value: object) -> None:
    """numpy does not check the position: 10**6 read past its 624 keys until the process died (SIGSEGV), 625
    drew garbage. Nothing is restored from a refused state, python's and torch's generators included."""
    captured = capture_rng()
    captured["numpy"][entry] = value
    seed_all(3)
    before = _draw()
    seed_all(3)
    with pytest.raises(StateError, match="numpy entry is not a MT19937 state"):
        restore_rng(captured)
    _assert_same_draws(_draw(), before)


class _FakeCuda:
    """Stands in for torch.cuda's generator API on this CPU-only build."""

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.restored: dict[int, torch.Tensor] = {}

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.devices > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.devices)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: torch.full((4,), device, dtype=torch.uint8))
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: self.restored.__setitem__(device, state))


def test_capture_and_restore_cover_every_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = _FakeCuda(devices=2)
    cuda.install(monkeypatch)
    captured = capture_rng()
    assert [state.tolist() for state in captured["cuda"]] == [[0] * 4, [1] * 4]
    restore_rng(captured)
    assert sorted(cuda.restored) == [0, 1]
    assert torch.equal(cuda.restored[1], captured["cuda"][1])


@pytest.mark.parametrize(
    ("saved", "devices", "message", "restored"),
    [
        ([torch.zeros(4, dtype=torch.uint8)] * 3, 2, "CUDA states for 3 device.*but 2 are available", [0, 1]),
        ([torch.zeros(4, dtype=torch.uint8)], 2, "CUDA states for 1 device.*but 2 are available", [0]),
        ([torch.zeros(4, dtype=torch.uint8)], 0, "CUDA states for 1 device.*but 0 are available", []),
        (None, 1, "no CUDA states", []),
    ],
)
def test_restore_tolerates_other_cuda_layouts_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, saved: Any, devices: int, message: str, restored: list[int]
) -> None:
    captured = capture_rng()
    cuda = _FakeCuda(devices)
    cuda.install(monkeypatch)
    if saved is None:
        del captured["cuda"]
    else:
        captured["cuda"] = saved
    with pytest.warns(UserWarning, match=message):
        restore_rng(captured)
    assert sorted(cuda.restored) == restored
    assert torch.equal(torch.get_rng_state(), captured["torch"])
