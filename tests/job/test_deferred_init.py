"""A start that expects a checkpoint builds the model without its random initialisation (job.deferred_init)."""
from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from torch import nn

from job import deferred_init
from job.build import build
from tests.support.jobs import assert_states_equal, ckpt_config, train_state

CPU = torch.device("cpu")


def _rng() -> tuple[torch.Tensor, object, dict]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=False)


def _inits_counted(monkeypatch) -> list[str]:
    """The torch.nn.init functions called from now on on real tensors (nn.Linear initialises through them;
    on the meta device they compute nothing)."""
    calls: list[str] = []

    def counted(name: str):
        original = getattr(nn.init, name)

        def init(tensor: torch.Tensor, *args, **kwargs):
            if tensor.device.type != "meta":
                calls.append(name)
            return original(tensor, *args, **kwargs)
        return init

    for name in ("kaiming_uniform_", "uniform_"):
        monkeypatch.setattr(nn.init, name, counted(name))
    return calls


def test_a_deferred_start_that_loads_nothing_equals_a_normal_start(tiny_config):
    normal = build(tiny_config())
    after_normal = _rng()
    deferred = build(tiny_config(), defer_init=True)
    assert deferred.pending_init is not None
    torch.rand(3), random.random(), np.random.rand()  # drawn meanwhile (botocore's retry jitter draws from random)
    deferred.initialise()
    assert deferred.pending_init is None
    for (name, a), b in zip(normal.state.model.state_dict().items(), deferred.state.model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    after = _rng()  # dropout draws from here on: the generators must be where a normal start leaves them
    assert torch.equal(after[0], after_normal[0]) and after[1] == after_normal[1]
    assert all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
               for x, y in zip(after[2]["state"].values(), after_normal[2]["state"].values()))
    trained = list(deferred.state.model.parameters())  # the optimizer steps the parameters the model computes with
    assert deferred.state.optimizers[0].param_groups[0]["params"] == trained


def test_a_resume_skips_the_random_initialisation_and_equals_an_uninterrupted_run(tiny_config, tmp_path,
                                                                                  monkeypatch):
    straight = train_state(tiny_config(), ckpt_config(tmp_path / "straight"))
    train_state(tiny_config(), ckpt_config(tmp_path / "resumed"), stop_at=30)
    calls = _inits_counted(monkeypatch)
    resumed = train_state(tiny_config(), ckpt_config(tmp_path / "resumed"))
    assert calls == []
    assert_states_equal(straight, resumed)
    train_state(tiny_config(max_duration="2ba"), ckpt_config(tmp_path / "fresh", resume="never"))
    assert calls  # the count sees a normal start's initialisation


def test_a_start_with_nothing_to_resume_initialises_as_before(tiny_config, tmp_path, monkeypatch):
    calls = _inits_counted(monkeypatch)
    state = train_state(tiny_config(max_duration="2ba"), ckpt_config(tmp_path / "new"))
    assert calls and state.timer.batch.value == 2


class _TiedPair(nn.Module):
    skip_init_on_resume = True

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(8))


class _Cache(_TiedPair):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.arange(8.0), persistent=False)


class _Attribute(_TiedPair):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.arange(8.0)


class _NoOptIn(_TiedPair):
    skip_init_on_resume = False


class _DataDependent(_TiedPair):
    def __init__(self) -> None:
        super().__init__()
        self.width = int(self.scale.sum().item())  # needs values: impossible on the meta device


def test_a_deferred_model_is_allocated_on_the_device_with_its_ties_kept():
    model, deferred = deferred_init.construct(_TiedPair, CPU, defer=True)
    assert deferred
    assert model.head.weight is model.embed.weight
    assert all(t.device == CPU for t in [*model.parameters(), *model.buffers()])
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in model.parameters())
    assert set(model.state_dict()) == set(_TiedPair().state_dict())


@pytest.mark.parametrize("factory, warned", [
    (_Cache, "non-persistent buffers (cache)"),
    (_Attribute, "keeps tensors outside its parameters and buffers (table)"),
    (_DataDependent, "could not be built on the meta device"),
    (_NoOptIn, None),
], ids=["non-persistent-buffer", "tensor-attribute", "data-dependent", "no-opt-in"])
def test_a_model_that_a_checkpoint_would_not_fully_restore_is_initialised(caplog, factory, warned):
    torch.manual_seed(3)
    expected = factory().state_dict()
    torch.manual_seed(3)
    with caplog.at_level(logging.WARNING, logger="job.deferred_init"):
        model, deferred = deferred_init.construct(factory, CPU, defer=True)
    assert not deferred
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    if factory is _Cache:
        assert torch.equal(model.cache, torch.arange(8.0))
    messages = [r.getMessage() for r in caplog.records if r.name == "job.deferred_init"]
    assert (messages == []) if warned is None else (len(messages) == 1 and warned in messages[0])
