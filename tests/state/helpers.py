"""Shared test helpers: a tiny training setup and deep equality for nested checkpoints."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from state import ResumableBatchSampler, State, seed_all

NUM_SAMPLES = 24
BATCH_SIZE = 4
NUM_CLASSES = 3
FEATURES = 5


@dataclass
class Setup:
    state: State
    sampler: ResumableBatchSampler
    inputs: torch.Tensor
    targets: torch.Tensor


MakeSetup = Callable[..., Setup]


def make_model() -> torch.nn.Module:
    # Dropout makes every step draw from the global torch RNG, so RNG restore is actually exercised.
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 8), torch.nn.ReLU(), torch.nn.Dropout(0.5), torch.nn.Linear(8, NUM_CLASSES)
    )


def build_setup(seed: int = 0, scaler: Any | None = None, **state_kwargs: Any) -> Setup:
    """A state whose initial weights depend on ``seed``, over a fixed dataset (the same for every seed)."""
    data = torch.Generator().manual_seed(1234)
    inputs = torch.randn(NUM_SAMPLES, FEATURES, generator=data)
    targets = torch.randint(0, NUM_CLASSES, (NUM_SAMPLES,), generator=data)
    seed_all(seed)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    state = State(
        model=model,
        max_duration="3ep",
        rank_zero_seed=seed,
        train_dataloader=[None] * (NUM_SAMPLES // BATCH_SIZE),
        optimizers=optimizer,
        scaler=scaler,
        train_metrics={"accuracy": MulticlassAccuracy(num_classes=NUM_CLASSES), "loss": MeanMetric()},
        **state_kwargs,
    )
    state.schedulers = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    sampler = ResumableBatchSampler(NUM_SAMPLES, BATCH_SIZE, seed=7)
    return Setup(state, sampler, inputs, targets)


def train(setup: Setup, steps: int) -> None:
    """Run ``steps`` optimizer steps, resuming the sampler from the timer each step as the job does."""
    state = setup.state
    state.model.train()
    for _ in range(steps):
        epoch, position = state.data_position
        if position == len(setup.sampler):
            state.timer.on_epoch_complete()
            epoch, position = state.data_position
        setup.sampler.set_epoch(epoch, position)
        indices = next(iter(setup.sampler))
        state.batch = (setup.inputs[indices], setup.targets[indices])
        inputs, targets = state.batch_pair
        with state.precision_context:
            logits = state.model(inputs)
            loss = torch.nn.functional.cross_entropy(logits, targets)
        for optimizer in state.optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in state.optimizers:
            optimizer.step()
        for scheduler in state.schedulers:
            scheduler.step()
        state.train_metrics["accuracy"].update(logits.detach().argmax(dim=1), targets)
        state.train_metrics["loss"].update(loss.detach())
        state.timer.on_batch_complete(samples=len(indices))


def save_and_load(obj: Any) -> Any:
    """What a checkpoint goes through: torch.save, then the safe loader."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_nested_equal(actual: Any, expected: Any, path: str = "") -> None:
    """Bit-exact equality through dicts, lists and tuples; tensors compared with torch.equal."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__} is not a tensor"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert torch.equal(actual, expected), f"{path}: tensors differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: {type(actual).__name__} is not a dict"
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_nested_equal(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), f"{path}: {type(actual).__name__} is not a sequence"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for index, (left, right) in enumerate(zip(actual, expected, strict=True)):
            assert_nested_equal(left, right, f"{path}[{index}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
