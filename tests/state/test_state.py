"""State attributes and properties, point by point against Composer's semantics."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchmetrics import MeanMetric, MetricCollection, SumMetric

from state import Evaluator, Precision, PrecisionError, State, Time, Timer, TimeUnit
from tests.state.helpers import make_model


def _state(**kwargs: Any) -> State:
    arguments: dict[str, Any] = {
        "model": torch.nn.Linear(2, 2),
        "max_duration": "2ep",
        "rank_zero_seed": 17,
        "train_dataloader": [0] * 5,
    }
    arguments.update(kwargs)
    return State(**arguments)


def test_constructor_arguments_are_kept() -> None:
    model, dataloader = torch.nn.Linear(2, 2), [0] * 5
    state = _state(model=model, train_dataloader=dataloader, rank_zero_seed=3, grad_accum=4)
    assert state.model is model
    assert state.train_dataloader is dataloader
    assert state.rank_zero_seed == 3
    assert state.grad_accum == 4
    assert isinstance(state.timer, Timer) and state.timer.state_dict()["batch"] == 0


def test_defaults() -> None:
    state = _state()
    assert state.evaluators == [] and state.optimizers == [] and state.schedulers == []
    assert state.algorithms == [] and state.callbacks == []
    assert state.scaler is None and state.profiler is None
    assert state.precision is Precision.FP32
    assert state.current_metrics == {} and state.train_metrics == {}
    assert (state.batch, state.batch_num_samples, state.batch_num_tokens, state.loss, state.outputs) == (
        None,
        0,
        0,
        None,
        None,
    )
    assert state.serialized_attributes == [
        "model",
        "optimizers",
        "schedulers",
        "algorithms",
        "callbacks",
        "scaler",
        "timer",
        "rank_zero_seed",
        "current_metrics",
        "train_metrics",
        "rng",
    ]


def test_profiler_is_settable() -> None:
    state = _state()
    profiler = object()
    state.profiler = profiler
    assert state.profiler is profiler


def test_seed_is_rank_zero_seed_without_a_process_group() -> None:
    assert _state(rank_zero_seed=17).seed == 17


def test_seed_adds_the_global_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *args, **kwargs: 3)
    assert _state(rank_zero_seed=17).seed == 20


@pytest.mark.usefixtures("gloo_group")
def test_seed_in_a_real_world_of_one() -> None:
    assert _state(rank_zero_seed=17).seed == 17 + dist.get_rank()


@pytest.mark.parametrize("grad_accum", [0, -2, 1.5])
def test_grad_accum_must_be_a_positive_int(grad_accum: object) -> None:
    with pytest.raises(ValueError, match="grad_accum must be an int >= 1"):
        _state(grad_accum=grad_accum)
    state = _state()
    with pytest.raises(ValueError, match="grad_accum"):
        state.grad_accum = grad_accum  # type: ignore[assignment]


def test_rank_zero_seed_must_be_an_int() -> None:
    with pytest.raises(TypeError, match="rank_zero_seed"):
        _state(rank_zero_seed="1")


@pytest.mark.parametrize(
    ("given", "expected"), [("10ba", Time(10, "ba")), (Time(3, "ep"), Time(3, "ep")), ("1e3tok", Time(1000, "tok"))]
)
def test_max_duration_accepts_time_or_timestring(given: object, expected: Time[int]) -> None:
    assert _state(max_duration=given).max_duration == expected


@pytest.mark.parametrize(
    ("given", "error", "message"),
    [
        ("0.5dur", ValueError, "cannot be given in 'dur'"),
        (Time(1.0, "dur"), ValueError, "'dur'"),
        ("0ep", ValueError, "positive"),
        (5, TypeError, "Time or a time string"),
    ],
)
def test_max_duration_refuses_bad_values(given: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _state(max_duration=given)


@pytest.mark.parametrize(
    ("max_duration", "advance", "expected"),
    [("4ep", {"epochs": 1}, 0.25), ("10ba", {"batches": 5}, 0.5), ("40sp", {"batches": 5}, 1.0), ("4ep", {}, 0.0)],
)
def test_elapsed_duration_is_progress_in_the_max_duration_unit(
    max_duration: str, advance: dict[str, int], expected: float
) -> None:
    state = _state(max_duration=max_duration)
    for _ in range(advance.get("batches", 0)):
        state.timer.on_batch_complete(samples=8)
    for _ in range(advance.get("epochs", 0)):
        state.timer.on_epoch_complete()
    elapsed = state.get_elapsed_duration()
    assert elapsed.unit is TimeUnit.DURATION and elapsed.value == expected


def test_data_position_is_epoch_and_batch_in_epoch() -> None:
    state = _state()
    for _ in range(3):
        state.timer.on_batch_complete(samples=1)
    state.timer.on_epoch_complete()
    state.timer.on_batch_complete(samples=1)
    assert state.data_position == (1, 1)
    assert all(type(value) is int for value in state.data_position)


def test_steps_per_epoch_defaults_to_the_dataloader_length() -> None:
    assert _state(train_dataloader=[0] * 7).steps_per_epoch == 7


def test_steps_per_epoch_can_be_smaller_silently() -> None:
    assert _state(train_dataloader=[0] * 7, steps_per_epoch=3).steps_per_epoch == 3


def test_steps_per_epoch_larger_than_the_dataloader_warns() -> None:
    with pytest.warns(UserWarning, match=r"steps_per_epoch \(9\) is greater than .* \(7\)"):
        state = _state(train_dataloader=[0] * 7, steps_per_epoch=9)
    assert state.steps_per_epoch == 9


def test_steps_per_epoch_without_a_sized_dataloader() -> None:
    assert _state(train_dataloader=iter([]), steps_per_epoch=4).steps_per_epoch == 4
    with pytest.raises(TypeError, match="set steps_per_epoch explicitly"):
        _ = _state(train_dataloader=iter([])).steps_per_epoch


@pytest.mark.parametrize("steps", [0, -1, 2.0])
def test_steps_per_epoch_must_be_positive(steps: object) -> None:
    with pytest.raises(ValueError, match="steps_per_epoch must be an int >= 1"):
        _state(steps_per_epoch=steps)


def test_precision_setter_accepts_strings() -> None:
    state = _state(precision_context=lambda precision: contextlib.nullcontext())
    state.precision = "amp_fp16"
    assert state.precision is Precision.AMP_FP16
    with pytest.raises(ValueError, match="valid values"):
        state.precision = "fp64"


def test_precision_context_comes_from_the_factory_for_the_current_precision() -> None:
    seen: list[Precision] = []

    def factory(precision: Precision) -> contextlib.AbstractContextManager[Any]:
        seen.append(precision)
        return contextlib.nullcontext(precision)

    state = _state(precision="amp_bf16", precision_context=factory)
    with state.precision_context as entered:
        assert entered is Precision.AMP_BF16
    state.precision = Precision.FP32
    with state.precision_context as entered:
        assert entered is Precision.FP32
    assert seen == [Precision.AMP_BF16, Precision.FP32]


def test_default_precision_context_is_a_null_context_for_fp32() -> None:
    assert isinstance(_state().precision_context, contextlib.nullcontext)


@pytest.mark.parametrize("precision", ["amp_fp16", "amp_bf16"])
def test_amp_without_cuda_fails_at_construction(monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PrecisionError, match=f"precision {precision} needs a CUDA GPU"):
        _state(precision=precision)
    state = _state()
    with pytest.raises(PrecisionError):
        state.precision = precision
    assert state.precision is Precision.FP32


_LIST_ATTRIBUTES = ["optimizers", "schedulers", "algorithms", "callbacks", "evaluators"]


@pytest.mark.parametrize("name", _LIST_ATTRIBUTES)
@pytest.mark.parametrize("wrap", [lambda items: items, tuple, lambda items: items[0]], ids=["list", "tuple", "single"])
def test_list_setters_replace_contents_in_place(name: str, wrap: Callable[[list[Any]], Any]) -> None:
    state = _state()
    held = getattr(state, name)
    held.append("stale")
    replacement = [object()]
    setattr(state, name, wrap(replacement))
    assert getattr(state, name) is held
    assert held == replacement


@pytest.mark.parametrize(
    ("name", "argument"),
    [
        ("optimizers", "optimizers"),
        ("algorithms", "algorithms"),
        ("callbacks", "callbacks"),
        ("evaluators", "evaluators"),
    ],
)
def test_constructor_wraps_a_single_object(name: str, argument: str) -> None:
    single: Any = Evaluator("val", [], {}) if name == "evaluators" else object()
    state = _state(**{argument: single})
    assert getattr(state, name) == [single]


def test_list_setter_accepts_none_as_empty() -> None:
    state = _state(callbacks=[object()])
    state.callbacks = None
    assert state.callbacks == []


def test_train_metrics_normalized_from_metric_collection() -> None:
    state = _state(train_metrics=MetricCollection({"mean": MeanMetric(), "sum": SumMetric()}))
    assert sorted(state.train_metrics) == ["mean", "sum"]
    state.train_metrics = MeanMetric()
    assert list(state.train_metrics) == ["MeanMetric"]


def test_scaler_is_kept() -> None:
    scaler = torch.amp.GradScaler("cpu")
    assert _state(scaler=scaler).scaler is scaler


@pytest.mark.parametrize("batch", [(1, 2), [1, 2]])
def test_batch_pair_returns_a_two_element_batch(batch: Any) -> None:
    state = _state()
    state.batch = batch
    assert state.batch_pair is batch


@pytest.mark.parametrize("batch", [(1, 2, 3), {"x": 1}, torch.zeros(2), None])
def test_batch_pair_refuses_other_shapes(batch: Any) -> None:
    state = _state()
    state.batch = batch
    with pytest.raises(TypeError, match="not an \\(inputs, targets\\) pair"):
        _ = state.batch_pair


def test_batch_dict() -> None:
    state = _state()
    state.batch = {"x": 1}
    assert state.batch_dict is state.batch
    state.batch = (1, 2)
    with pytest.raises(TypeError, match="not a dict: got a tuple of length 2"):
        _ = state.batch_dict


def test_plain_model_is_neither_ddp_nor_deepspeed() -> None:
    state = _state(model=make_model())
    assert state.is_model_ddp is False
    assert state.is_model_deepspeed is False
    with pytest.raises(TypeError, match="not a DeepSpeed engine"):
        _ = state.deepspeed_model


@pytest.mark.usefixtures("gloo_group")
def test_ddp_model_is_detected() -> None:
    state = _state(model=torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2)))
    assert state.is_model_ddp is True
    assert state.is_model_deepspeed is False


def test_deepspeed_engine_is_detected_when_deepspeed_is_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_deepspeed = types.ModuleType("deepspeed")

    class DeepSpeedEngine(torch.nn.Module):
        pass

    fake_deepspeed.DeepSpeedEngine = DeepSpeedEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", fake_deepspeed)
    engine = DeepSpeedEngine()
    state = _state(model=engine)
    assert state.is_model_deepspeed is True
    assert state.deepspeed_model is engine
    assert _state().is_model_deepspeed is False
