"""A start that expects a checkpoint builds the model without its random initialisation (job.deferred_init)."""
from __future__ import annotations

import json
import logging
import random
import shutil
import sys
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from torch.utils.data import TensorDataset

from job import deferred_init
from job.build import build
from job.builtin import MLP
from job.storage import RemoteConfig
from state import seed_all
from tests.support.elastic import TORCHRUN
from tests.support.jobs import JobProcess, assert_states_equal, ckpt_config, inspect, job_env, train_state
from uploader.config import UploadConfig
from uploader.local import checkpoint_name

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


def noisy(split: str) -> TensorDataset:
    """A --data set drawn from the global torch generator when built (the README allows it)."""
    x = torch.randn(512 if split == "train" else 128, 2)
    return TensorDataset(x, (x[:, 0] * x[:, 1] > 0).long() + (x[:, 0] > 1).long())


def _empty_remote(tmp_path) -> RemoteConfig:
    """A --remote with nothing in it: the start expects a checkpoint and finds none."""
    return RemoteConfig(url=f"file://{tmp_path / 'bucket'}", mode="inprocess", upload=UploadConfig())


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


@pytest.mark.parametrize("data", ["spirals", f"{__name__}:noisy"])
def test_a_first_start_with_an_empty_remote_equals_a_start_that_expects_nothing(tiny_config, tmp_path, monkeypatch,
                                                                              data):
    cfg = tiny_config(data=data, max_duration="12ba")
    normal = train_state(cfg, ckpt_config(tmp_path / "normal", resume="never"))
    calls = _inits_counted(monkeypatch)
    deferred = train_state(cfg, ckpt_config(tmp_path / "deferred"), remote_cfg=_empty_remote(tmp_path))
    assert calls  # initialised after all, once nothing was found
    assert_states_equal(normal, deferred)


def test_a_resume_with_data_drawn_from_the_global_generator_equals_an_uninterrupted_run(tiny_config, tmp_path):
    cfg = tiny_config(data=f"{__name__}:noisy", max_duration="20ba")
    straight = train_state(cfg, ckpt_config(tmp_path / "straight"))
    train_state(cfg, ckpt_config(tmp_path / "resumed"), stop_at=9)
    assert_states_equal(straight, train_state(cfg, ckpt_config(tmp_path / "resumed")))


def test_a_factory_that_does_not_opt_in_is_called_once_as_before(caplog):
    calls = []

    def factory() -> nn.Module:
        calls.append(random.random())
        layer = nn.Linear(2, 2)
        layer.threshold = float(layer.weight.sum().item())  # a value: impossible on the meta device
        return layer

    with caplog.at_level(logging.DEBUG, logger="job.deferred_init"):
        model, deferred = deferred_init.construct(factory, CPU, defer=True)
    assert not deferred and len(calls) == 1 and model.weight.device == CPU
    assert [r for r in caplog.records if r.name == "job.deferred_init"] == []


class _TiedPair(nn.Module):
    skip_init_on_resume = True

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(8))
        self.draw = random.random() + float(np.random.rand())  # not in the state_dict: the same on every build


class _Cache(_TiedPair):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.arange(8.0), persistent=False)


class _Attribute(_TiedPair):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.arange(8.0)


class _AttributeInAList(_TiedPair):
    def __init__(self) -> None:
        super().__init__()
        self.tables = {"sin": [torch.arange(8.0)], "rows": 8}


class _NoOptIn(_TiedPair):
    skip_init_on_resume = False


class _Lazy(_TiedPair):
    def __init__(self) -> None:
        super().__init__()
        self.tail = nn.LazyLinear(8)


class _ChannelsLast(nn.Module):
    skip_init_on_resume = True

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3).to(memory_format=torch.channels_last)


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
    layout, _ = deferred_init.construct(_ChannelsLast, CPU, defer=True)
    assert layout.conv.weight.stride() == _ChannelsLast().conv.weight.stride() != (36, 9, 3, 1)


class _Recurrent(nn.Module):
    skip_init_on_resume = True

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 8, num_layers=2)  # lists its own parameters again in _flat_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def test_a_recurrent_model_is_deferred_and_computes_with_what_is_loaded():
    model, deferred = deferred_init.construct(_Recurrent, CPU, defer=True)
    assert deferred
    twin = _Recurrent()
    model.load_state_dict(twin.state_dict())
    x = torch.randn(3, 2, 4)
    assert torch.equal(model(x), twin(x))


@pytest.mark.parametrize("factory, warned", [
    (_Cache, "non-persistent buffers (cache)"),
    (_Attribute, "keeps tensors outside its parameters and buffers (table)"),
    (_AttributeInAList, "keeps tensors outside its parameters and buffers (tables)"),
    (_Lazy, "has lazy parameters in tail (weight, bias)"),
    (_DataDependent, "could not be built on the meta device"),
    (_NoOptIn, None),
], ids=["non-persistent-buffer", "tensor-attribute", "tensors-in-a-dict-of-lists", "lazy", "data-dependent",
        "no-opt-in"])
def test_a_model_that_a_checkpoint_would_not_fully_restore_is_initialised(caplog, factory, warned):
    seed_all(3)
    built = factory()
    expected, after_expected = built.state_dict(), _rng()
    seed_all(3)
    with caplog.at_level(logging.WARNING, logger="job.deferred_init"):
        model, deferred = deferred_init.construct(factory, CPU, defer=True)
    assert not deferred
    assert model.draw == built.draw and _rng()[1] == after_expected[1]  # the meta attempt's draws are undone
    for name, value in model.state_dict().items():
        if not isinstance(value, nn.parameter.UninitializedTensorMixin):
            assert torch.equal(value, expected[name]), name
    if factory is _Cache:
        assert torch.equal(model.cache, torch.arange(8.0))
    messages = [r.getMessage() for r in caplog.records if r.name == "job.deferred_init"]
    assert (messages == []) if warned is None else (len(messages) == 1 and warned in messages[0])


class _Bf16Saved(_TiedPair):
    """Computes in float32, saves bfloat16: its state_dict holds new tensors, not its own."""

    def __init__(self) -> None:
        super().__init__()
        self._register_state_dict_hook(lambda module, sd, prefix, meta: {k: v.to(torch.bfloat16)
                                                                         for k, v in sd.items()})


def test_initialise_fills_the_models_own_tensors_whatever_its_state_dict_returns():
    seed_all(5)
    expected = {k: v.clone() for k, v in _Bf16Saved().named_parameters()}
    model, deferred = deferred_init.construct(_Bf16Saved, CPU, defer=True)
    assert deferred
    deferred_init.initialise(model, _Bf16Saved, lambda: seed_all(5))
    for name, value in model.named_parameters():
        assert value.dtype == torch.float32 and torch.equal(value, expected[name]), name


def test_initialise_writes_a_tied_weight_once_and_keeps_it_tied(monkeypatch):
    seed_all(5)
    expected = _TiedPair().state_dict()
    model, _ = deferred_init.construct(_TiedPair, CPU, defer=True)
    written: list[int] = []
    fresh_weights = torch.Tensor.detach

    def detach(tensor: torch.Tensor) -> torch.Tensor:  # initialise detaches each of the fresh model's tensors it copies
        written.append(id(tensor))
        return fresh_weights(tensor)

    monkeypatch.setattr(torch.Tensor, "detach", detach)
    deferred_init.initialise(model, _TiedPair, lambda: seed_all(5))
    monkeypatch.undo()
    assert model.head.weight is model.embed.weight
    assert len(written) == len(set(written)) == 4  # embed.weight (head.weight the same), two biases, scale
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_a_build_that_starts_over_lets_go_of_the_deferred_model_first(tiny_config, monkeypatch):
    shells: list[weakref.ref] = []
    alive_at_second_data_build: list[bool] = []
    materialise = deferred_init._materialise

    def recorded(model: nn.Module, device: torch.device) -> None:
        shells.append(weakref.ref(model))
        materialise(model, device)

    def data(split: str) -> TensorDataset:
        if split == "train" and shells and len(alive_at_second_data_build) < 2:
            alive_at_second_data_build.append(shells[0]() is not None)
        return noisy(split)

    monkeypatch.setattr(deferred_init, "_materialise", recorded)
    monkeypatch.setattr(sys.modules[__name__], "noisy_recorded", data, raising=False)
    run = build(tiny_config(data=f"{__name__}:noisy_recorded"), defer_init=True)
    assert run.pending_init is None  # started over without deferring: the data set draws from torch's generator
    assert alive_at_second_data_build == [True, False]


# -- two ranks (DistributedDataParallel, or FSDP2 with --sharded, under torchrun, CPU, gloo) ---------------

DDP_ARGS = ["--max-duration", "12ba", "--save-interval", "4ba", "--eval-interval", "6ba", "--batch-size", "32",
            "--seed", "5", "--log-format", "json"]


def _two_ranks(folder, *extra: str, timeout: float = 300) -> list[dict]:
    """`job train` with the built-in MLP (it opts in) on two ranks, to the end; its events."""
    proc = JobProcess([*TORCHRUN, "--nproc-per-node", "2", "-m", "job", "train", *DDP_ARGS, "--save-folder",
                       str(folder), *extra], env=job_env())
    code = proc.wait(timeout)
    assert code == 0, proc.stderr[-3000:]
    return proc.events


def _built_deferred(events: list[dict]) -> list[bool]:
    return [e["deferred_init"] for e in events if e.get("event") == "built"]


SHARDING = pytest.mark.parametrize("mode", [[], ["--sharded"]], ids=["ddp", "sharded"])


def plain_mlp() -> nn.Module:
    """The built-in MLP from a factory that does not opt in: always built with its random initialisation."""
    return MLP()


@pytest.mark.slow
@SHARDING
def test_two_ranks_that_find_no_checkpoint_start_as_a_normal_start(tmp_path, mode):
    """Each rank initialises its own weights (seeded by its rank) after the uninitialised model was wrapped.
    DistributedDataParallel: without rank 0's weights broadcast then, the ranks train different models.
    FSDP2: each rank's shards must get the slice of its own model that sharding it gives on a normal start;
    a sharded model that opts in is deferred on every start, with or without a checkpoint to expect."""
    normal = _two_ranks(tmp_path / "normal", "--resume", "never", "--model", f"{__name__}:plain_mlp", *mode)
    expects = ["--resume", "never"] if mode else ["--remote", f"file://{tmp_path / 'bucket'}"]
    deferred = _two_ranks(tmp_path / "deferred", *expects, *mode)
    assert _built_deferred(normal) == [False] and _built_deferred(deferred) == [True]
    assert inspect(tmp_path / "deferred")["model_sha256"] == inspect(tmp_path / "normal")["model_sha256"]


@pytest.mark.slow
def test_two_ranks_build_again_together_when_one_draws_from_the_generators(tmp_path):
    """Rank 0's data set draws when built, rank 1's does not: rank 0 alone built again once and went on to
    other collectives than rank 1's, and the run hung. Now both build again, without deferring."""
    data = ["--data", "tests.support.rank_zero_draws:build"]
    normal = _two_ranks(tmp_path / "normal", "--resume", "never", *data, timeout=120)
    again = _two_ranks(tmp_path / "again", "--remote", f"file://{tmp_path / 'bucket'}", *data, timeout=120)
    assert _built_deferred(normal) == _built_deferred(again) == [False]
    assert inspect(tmp_path / "again")["model_sha256"] == inspect(tmp_path / "normal")["model_sha256"]


@pytest.mark.slow
@SHARDING
def test_two_ranks_resume_without_the_random_initialisation_and_equal_an_uninterrupted_run(tmp_path, mode):
    straight = tmp_path / "straight"
    _two_ranks(straight, "--resume", "never", *mode)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / checkpoint_name(4), resumed / checkpoint_name(4))  # as if stopped at step 4
    events = _two_ranks(resumed, *mode)
    assert _built_deferred(events) == [True]
    assert [e["step"] for e in events if e.get("event") == "resumed"] == [4]
    assert inspect(resumed)["model_sha256"] == inspect(straight)["model_sha256"]


@pytest.mark.slow
def test_a_sharded_build_never_allocates_a_whole_parameter_on_the_device(tmp_path):
    """Sharded on the meta device, then only each rank's shards allocated (job.deferred_init.allocate_shards):
    a model that does not fit one device can be built. The control, a factory that does not opt in, is built
    whole on each rank first, and the same measurement sees it."""
    found = {}
    for model in ("wide", "wide_plain"):
        out = tmp_path / model
        out.mkdir()
        proc = JobProcess([*TORCHRUN, "--nproc-per-node", "2", "-m", "tests.support.sharded_allocations", model,
                           str(out)], env=job_env())
        assert proc.wait(120) == 0, proc.stderr[-3000:]
        found[model] = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    for rank in found["wide"]:
        assert rank["deferred"] and rank["largest"] == rank["parameter"] // 2  # its shard: two ranks
    assert all(not rank["deferred"] and rank["largest"] == rank["parameter"] for rank in found["wide_plain"])
