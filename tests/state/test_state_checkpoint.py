"""State.state_dict / load_state_dict: layout, compatibility with older checkpoints, and bit-exact resume."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torchmetrics import MeanMetric

from state import Serializable, State, StateError, capture_rng, restore_rng
from tests.state.helpers import MakeSetup, Setup, assert_nested_equal, make_model, save_and_load, train


class Counter(Serializable):
    """A stateful callback: its count must come back from the checkpoint."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


class Stateless(Serializable):
    pass


def _trained(make_setup: MakeSetup, steps: int = 4, **kwargs: Any) -> Setup:
    setup = make_setup(**kwargs)
    train(setup, steps)
    return setup


def test_state_dict_layout(make_setup: MakeSetup) -> None:
    setup = _trained(make_setup, callbacks=[Counter()], algorithms=Stateless())
    saved = setup.state.state_dict()
    assert list(saved) == setup.state.serialized_attributes
    assert_nested_equal(saved["model"], setup.state.model.state_dict())
    assert list(saved["optimizers"]) == ["AdamW"]
    assert list(saved["schedulers"]) == ["StepLR"]
    assert saved["callbacks"] == {"Counter": {"count": 0}}
    assert saved["algorithms"] == {"Stateless": {}}
    assert saved["scaler"] == {}
    assert saved["timer"] == {
        "Timer": {
            "epoch": 0,
            "batch": 4,
            "sample": 16,
            "token": 0,
            "batch_in_epoch": 4,
            "sample_in_epoch": 16,
            "token_in_epoch": 0,
        }
    }
    assert saved["rank_zero_seed"] == 0
    assert saved["current_metrics"] == {}
    assert sorted(saved["train_metrics"]) == ["accuracy", "loss"]
    assert saved["train_metrics"]["loss"]["update_count"] == 4
    assert set(saved["rng"]) == {"python", "numpy", "torch", "cuda"}


def test_serialized_attributes_selects_what_is_saved(make_setup: MakeSetup) -> None:
    state = make_setup().state
    state.serialized_attributes = ["timer", "rank_zero_seed"]
    assert list(state.state_dict()) == ["timer", "rank_zero_seed"]


def test_rng_is_captured_when_state_dict_is_called(make_setup: MakeSetup) -> None:
    state = make_setup().state
    torch.rand(5)
    saved = state.state_dict()
    assert torch.equal(saved["rng"]["torch"], torch.get_rng_state())


def test_two_objects_of_one_type_cannot_be_checkpointed(make_setup: MakeSetup) -> None:
    state = make_setup(callbacks=[Counter(), Counter()]).state
    with pytest.raises(StateError, match="two callbacks of type Counter"):
        state.state_dict()


@pytest.mark.parametrize(
    "scaler",
    [None, torch.amp.GradScaler("cuda", enabled=False), torch.amp.GradScaler("cpu")],
    ids=["no-scaler", "disabled-scaler", "cpu-scaler"],
)
def test_realistic_state_survives_a_weights_only_checkpoint(make_setup: MakeSetup, scaler: Any) -> None:
    setup = _trained(make_setup, scaler=scaler, callbacks=Counter())
    setup.state.current_metrics = {"train": {"accuracy": torch.tensor(0.5)}}
    saved = setup.state.state_dict()
    assert_nested_equal(save_and_load(saved), saved)


def test_load_restores_every_serialized_attribute(make_setup: MakeSetup) -> None:
    source = _trained(make_setup, callbacks=Counter())
    source.state.callbacks[0].count = 5
    source.state.current_metrics = {"train": {"accuracy": torch.tensor(0.25)}}
    source.state.rank_zero_seed = 99
    saved = save_and_load(source.state.state_dict())

    target = make_setup(seed=1, callbacks=Counter()).state
    assert not torch.equal(target.model.state_dict()["0.weight"], saved["model"]["0.weight"])  # the test can fail
    target.load_state_dict(saved)
    assert_nested_equal(target.model.state_dict(), source.state.model.state_dict())
    assert_nested_equal(target.optimizers[0].state_dict(), source.state.optimizers[0].state_dict())
    assert target.schedulers[0].state_dict() == source.state.schedulers[0].state_dict()
    assert target.timer.state_dict() == source.state.timer.state_dict()
    assert target.callbacks[0].count == 5
    assert target.rank_zero_seed == 99
    assert_nested_equal(target.current_metrics, source.state.current_metrics)
    for name, metric in source.state.train_metrics.items():
        assert torch.equal(target.train_metrics[name].compute(), metric.compute())
    assert torch.equal(torch.get_rng_state(), saved["rng"]["torch"])


def _assert_same_training(left: State, right: State) -> None:
    for (name, mine), theirs in zip(left.model.named_parameters(), right.model.parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    assert_nested_equal(left.optimizers[0].state_dict(), right.optimizers[0].state_dict())
    assert left.schedulers[0].state_dict() == right.schedulers[0].state_dict()
    assert left.timer.state_dict() == right.timer.state_dict()
    for name, metric in left.train_metrics.items():
        assert torch.equal(metric.compute(), right.train_metrics[name].compute()), name


@pytest.mark.parametrize("through_checkpoint", [True, False], ids=["weights-only-checkpoint", "live-state-dict"])
def test_resume_is_bit_exact(make_setup: MakeSetup, through_checkpoint: bool) -> None:
    """A: 4 steps, checkpoint, 3 more. B: fresh (other init), load, 3 steps. Everything must match.

    The live variant loads the very dict A keeps training with, so it also proves B shares no buffers with A.
    """
    uninterrupted = _trained(make_setup, steps=4)
    saved = uninterrupted.state.state_dict()
    if through_checkpoint:
        saved = save_and_load(saved)

    resumed = make_setup(seed=1)
    resumed.state.load_state_dict(saved)
    train(resumed, 3)  # crosses into epoch 1: six batches per epoch

    restore_rng(saved["rng"])  # A continues from the moment of the checkpoint, as if B had never run
    train(uninterrupted, 3)
    assert resumed.state.data_position == (1, 1)
    _assert_same_training(uninterrupted.state, resumed.state)


def test_resume_without_rng_diverges(make_setup: MakeSetup) -> None:
    """Control for the test above: dropout makes the RNG matter, so restoring it is what makes resume exact."""
    uninterrupted = _trained(make_setup, steps=4)
    uninterrupted.state.serialized_attributes.remove("rng")
    rng = capture_rng()
    saved = save_and_load(uninterrupted.state.state_dict())
    resumed = make_setup(seed=1)
    resumed.state.serialized_attributes.remove("rng")
    resumed.state.load_state_dict(saved)
    train(resumed, 3)
    restore_rng(rng)
    train(uninterrupted, 3)
    with pytest.raises(AssertionError):
        _assert_same_training(uninterrupted.state, resumed.state)


def test_loading_does_not_alias_the_checkpoint_tensors(make_setup: MakeSetup) -> None:
    saved = save_and_load(_trained(make_setup).state.state_dict())
    expected = save_and_load(saved)  # an independent copy
    target = make_setup(seed=1)
    target.state.load_state_dict(saved)
    train(target, 2)
    assert_nested_equal(saved["optimizers"], expected["optimizers"])


def test_a_structure_shared_many_times_over_is_copied_once_and_a_cycle_ends(make_setup: MakeSetup) -> None:
    """A checkpoint is untrusted and pickle keeps sharing: 1.4 KB held a list shared 40 levels deep, which
    a copy per reference turned into 2**40 copies (a hung start-up). Copied as deepcopy does: once each."""
    shared: list[Any] = [torch.ones(2)]
    for _ in range(12):  # 4096 references to the one tensor; 2**40 in the hostile checkpoint
        shared = [shared, shared]
    cycle: list[Any] = [torch.zeros(1)]
    cycle.append(cycle)
    saved = save_and_load(_trained(make_setup).state.state_dict())
    saved["current_metrics"] = {"eval": {"shared": shared, "cycle": cycle}}
    target = make_setup(seed=1)
    target.state.load_state_dict(save_and_load(saved))  # through torch.save/load: the sharing is the file's
    loaded = target.state.current_metrics["eval"]
    inner = loaded["shared"]
    for _ in range(12):
        assert inner[0] is inner[1]
        inner = inner[0]
    assert torch.equal(inner[0], torch.ones(2))
    assert loaded["cycle"][1] is loaded["cycle"] and torch.equal(loaded["cycle"][0], torch.zeros(1))


# --- missing, extra and read-only entries ----------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["optimizers", "timer", "rng", "train_metrics", "current_metrics"])
def test_an_attribute_missing_from_the_checkpoint_warns_and_the_rest_loads(make_setup: MakeSetup, missing: str) -> None:
    saved = _trained(make_setup).state.state_dict()
    del saved[missing]
    target = make_setup(seed=1).state
    with pytest.warns(UserWarning, match=f"the checkpoint has no '{missing}'"):
        target.load_state_dict(saved)
    assert_nested_equal(target.model.state_dict(), saved["model"])


def test_an_object_missing_from_the_checkpoint_warns_and_keeps_its_state(make_setup: MakeSetup) -> None:
    saved = make_setup().state.state_dict()
    target = make_setup(callbacks=Counter()).state
    target.callbacks[0].count = 3
    with pytest.warns(UserWarning, match=r"Counter \(in callbacks\) is not in the checkpoint"):
        target.load_state_dict(saved)
    assert target.callbacks[0].count == 3


def test_a_train_metric_missing_from_the_checkpoint_warns(make_setup: MakeSetup) -> None:
    saved = _trained(make_setup).state.state_dict()
    target = make_setup(seed=1).state
    target.train_metrics = {**target.train_metrics, "extra": MeanMetric()}
    with pytest.warns(UserWarning, match="train metric 'extra' is not in the checkpoint"):
        target.load_state_dict(saved)
    assert target.train_metrics["loss"].update_count == 4


def test_unknown_entries_are_ignored(make_setup: MakeSetup) -> None:
    saved = make_setup().state.state_dict()
    saved["from_a_newer_version"] = {"x": 1}
    saved["callbacks"]["RemovedCallback"] = {"count": 1}
    target = make_setup().state
    target.load_state_dict(saved)
    assert not hasattr(target, "from_a_newer_version")


def test_read_only_attributes_are_skipped(make_setup: MakeSetup) -> None:
    state = make_setup().state
    state.serialized_attributes.append("is_model_ddp")
    saved = state.state_dict()
    assert saved["is_model_ddp"] is False
    saved["is_model_ddp"] = True  # must not raise, and cannot change what the model is
    state.load_state_dict(saved)
    assert state.is_model_ddp is False


def test_leading_underscores_of_old_checkpoints_are_dropped(make_setup: MakeSetup) -> None:
    source = _trained(make_setup)
    saved = {
        f"_{key}" if key in ("optimizers", "timer") else key: value for key, value in source.state.state_dict().items()
    }
    target = make_setup(seed=1).state
    target.load_state_dict(saved)
    assert target.timer.state_dict() == source.state.timer.state_dict()
    assert_nested_equal(target.optimizers[0].state_dict(), source.state.optimizers[0].state_dict())


# --- model keys: strict loading and the DDP prefix -------------------------------------------------------------


def test_non_strict_model_load_logs_missing_and_unexpected_keys(
    make_setup: MakeSetup, caplog: pytest.LogCaptureFixture
) -> None:
    saved = make_setup().state.state_dict()
    saved["model"]["9.weight"] = torch.zeros(1)
    del saved["model"]["3.bias"]
    target = make_setup(seed=1).state
    with caplog.at_level(logging.WARNING, logger="state.state"):
        target.load_state_dict(saved)
    messages = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any("lacks these model keys" in message and "3.bias" in message for message in messages)
    assert any("this model lacks" in message and "9.weight" in message for message in messages)
    assert torch.equal(target.model.state_dict()["0.weight"], saved["model"]["0.weight"])


def test_strict_model_load_raises_on_mismatched_keys(make_setup: MakeSetup) -> None:
    saved = make_setup().state.state_dict()
    del saved["model"]["3.bias"]
    with pytest.raises(RuntimeError, match="3.bias"):
        make_setup(seed=1).state.load_state_dict(saved, strict=True)


def _with_ddp_prefix(model_state: dict[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
    return OrderedDict((f"module.{key}", value) for key, value in model_state.items())


@pytest.mark.parametrize("flag", ["is_model_ddp", "_is_model_ddp_wrapped"])
def test_prefixed_checkpoint_loads_into_a_plain_model(make_setup: MakeSetup, flag: str) -> None:
    source = make_setup().state
    saved = source.state_dict()
    saved["model"] = _with_ddp_prefix(saved["model"])
    saved[flag] = True
    prefixed = dict(saved["model"])
    target = make_setup(seed=1).state
    target.load_state_dict(saved, strict=True)
    assert_nested_equal(target.model.state_dict(), source.model.state_dict())
    assert dict(saved["model"]) == prefixed  # the caller's checkpoint is not modified


def test_prefixed_keys_without_the_ddp_flag_are_not_stripped(make_setup: MakeSetup) -> None:
    saved = make_setup().state.state_dict()
    saved["model"] = _with_ddp_prefix(saved["model"])
    with pytest.raises(RuntimeError, match="Missing key"):
        make_setup(seed=1).state.load_state_dict(saved, strict=True)


def _inner(state: State) -> torch.nn.Module:
    assert isinstance(state.model, torch.nn.parallel.DistributedDataParallel)
    module = state.model.module
    assert isinstance(module, torch.nn.Module)
    return module


def _ddp_setup(make_setup: MakeSetup, seed: int) -> Setup:
    setup = make_setup(seed=seed)
    setup.state.model = torch.nn.parallel.DistributedDataParallel(setup.state.model)
    return setup


@pytest.mark.usefixtures("gloo_group")
def test_ddp_checkpoint_has_no_prefix_and_loads_into_plain_and_ddp_models(make_setup: MakeSetup) -> None:
    source = _ddp_setup(make_setup, seed=0).state
    saved = save_and_load(source.state_dict())
    assert not any(key.startswith("module.") for key in saved["model"])
    assert_nested_equal(saved["model"], _inner(source).state_dict())

    plain = make_setup(seed=1).state
    plain.load_state_dict(saved, strict=True)
    assert_nested_equal(plain.model.state_dict(), _inner(source).state_dict())

    wrapped = _ddp_setup(make_setup, seed=2).state
    wrapped.load_state_dict(saved, strict=True)
    assert_nested_equal(_inner(wrapped).state_dict(), _inner(source).state_dict())


@pytest.mark.usefixtures("gloo_group")
def test_prefixed_checkpoint_loads_into_a_ddp_model(make_setup: MakeSetup) -> None:
    source = make_setup().state
    saved = source.state_dict()
    saved["model"] = _with_ddp_prefix(saved["model"])
    saved["is_model_ddp"] = True
    wrapped = _ddp_setup(make_setup, seed=1).state
    wrapped.load_state_dict(saved, strict=True)
    assert_nested_equal(_inner(wrapped).state_dict(), source.model.state_dict())


def test_make_model_is_what_the_checkpoint_tests_index() -> None:
    # The tests above address layers by index ("0.weight", "3.bias"); keep them honest if the model changes.
    assert [name for name, _ in make_model().named_parameters()] == ["0.weight", "0.bias", "3.weight", "3.bias"]
