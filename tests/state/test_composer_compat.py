"""Issue 20: what Composer v0.6 users rely on in Time, Timer and State checkpoints.

The expectations come from Composer v0.6.0's documentation and tests (``tests/test_time.py``, the
docstrings of ``composer/core/time.py``); where spot-trainer deliberately differs, the test says so.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pytest
import torch

from state import Precision, PrecisionError, StateError, Time, Timer, TimeUnit
from tests.state.composer_reference import TIMER_KEYS, ComposerV06Timer, composer_state_dict
from tests.state.helpers import MakeSetup, assert_nested_equal, save_and_load, train

# --- 1. Time -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expected", "time"),
    [
        ("1ep", Time(1, TimeUnit.EPOCH)),
        ("2ba", Time(2, TimeUnit.BATCH)),
        ("3sp", Time(3, TimeUnit.SAMPLE)),
        ("4tok", Time(4, TimeUnit.TOKEN)),
        ("0.5dur", Time(0.5, TimeUnit.DURATION)),
    ],
)
def test_to_timestring(expected: str, time: Time[Any]) -> None:
    assert time.to_timestring() == expected
    assert Time.from_timestring(time.to_timestring()) == time


def test_composer_time_math() -> None:
    """Composer v0.6's test_time_math, line by line."""
    t1, t2, t3, t4 = (Time.from_timestring(text) for text in ("1ep", "2ep", "3ep", "0.5dur"))
    assert t1 + t2 == t3
    assert t2 - t1 == t1
    assert t1 - t2 == -t1
    assert t1 < t2 and t1 <= t2 and t2 > t1 and t2 >= t1 and t3 >= t3 and t3 <= t3
    assert t4 * t2 == t1
    assert 0.5 * t2 == t1
    assert t4 * 2 == Time.from_timestring("1dur")
    assert t1 / t2 == t4
    assert t2 / 2 == t1


def _same(actual: Time[Any], value: float, unit: str, value_type: type) -> None:
    assert (actual.value, actual.unit) == (value, TimeUnit(unit))
    assert type(actual.value) is value_type


def test_unary_minus_and_plus_keep_unit_and_type() -> None:
    _same(-Time(3, "ba"), -3, "ba", int)
    _same(+Time(3, "ba"), 3, "ba", int)
    _same(-Time(0.25, "dur"), -0.25, "dur", float)
    assert -(-Time(7, "tok")) == Time(7, "tok")


@pytest.mark.parametrize(
    ("product", "value", "unit", "value_type"),
    [
        (lambda: Time(2, "ep") * 0.5, 1, "ep", int),
        (lambda: 0.5 * Time(2, "ep"), 1, "ep", int),
        (lambda: Time(0.5, "dur") * Time(2, "ep"), 1, "ep", int),
        (lambda: Time(2, "ep") * Time(0.5, "dur"), 1, "ep", int),
        (lambda: Time(0.5, "dur") * 2, 1.0, "dur", float),
        (lambda: 2 * Time(0.5, "dur"), 1.0, "dur", float),
        (lambda: Time(0.5, "dur") * Time(0.5, "dur"), 0.25, "dur", float),
        (lambda: Time(3, "ba") * 4, 12, "ba", int),
        (lambda: Time(4, "ep") / 2, 2, "ep", int),
        (lambda: Time(1, "dur") / 4, 0.25, "dur", float),
        (lambda: Time(4, "ep") / Time(2, "ep"), 2.0, "dur", float),
    ],
)
def test_scaling_keeps_composer_units_and_types(product: Any, value: float, unit: str, value_type: type) -> None:
    _same(product(), value, unit, value_type)


def test_scaled_counts_truncate_like_composer() -> None:
    _same(Time(3, "ep") * 0.5, 1, "ep", int)
    _same(Time(5, "ep") / 2, 2, "ep", int)
    _same(Time(12, "ep") * Time(0.1, "dur"), 1, "ep", int)


def test_float_noise_does_not_lose_a_count() -> None:
    """Deliberate difference: Composer's int(100 * 0.29) is 28 (0.29 * 100 == 28.999999999999996)."""
    _same(Time(100, "ba") * 0.29, 29, "ba", int)
    _same(Time(0.29, "dur") * Time(100, "ba"), 29, "ba", int)
    _same(Time(7, "ep") / (7 / 3), 3, "ep", int)


def test_duration_values_are_floats() -> None:
    _same(Time(1, "dur"), 1.0, "dur", float)
    _same(Time.from_duration(3), 3.0, "dur", float)


@pytest.mark.parametrize(
    "operation",
    [lambda: Time(2, "ep") * Time(3, "ep"), lambda: Time(2, "ep") * Time(3, "ba")],
    ids=["same unit", "different units"],
)
def test_two_counts_cannot_be_multiplied(operation: Any) -> None:
    with pytest.raises(TypeError, match="must be a fraction in 'dur'"):
        operation()


@pytest.mark.parametrize("other", ["2", None, True])
def test_scaling_refuses_non_numbers(other: object) -> None:
    with pytest.raises(TypeError):
        Time(2, "ep") * other  # type: ignore[operator]
    with pytest.raises(TypeError):
        Time(2, "ep") / other  # type: ignore[operator]


def test_division_by_zero_raises() -> None:
    with pytest.raises(ZeroDivisionError):
        Time(2, "ep") / 0


def test_int_and_float_conversions() -> None:
    assert int(Time(3, "ep")) == 3 and float(Time(0.5, "dur")) == 0.5


def test_repr_evaluates_back_to_the_same_time() -> None:
    time = Time(1, "tok")
    assert repr(time) == "Time(1, TimeUnit.TOKEN)"
    assert eval(repr(time)) == time  # noqa: S307 - Composer's own check of repr


# --- 2. Timer ----------------------------------------------------------------------------------------------


def test_composer_timer() -> None:
    """Composer v0.6's test_timer, line by line."""
    timer = Timer()
    timer.on_batch_complete(10, 20)
    timer.on_epoch_complete()
    timer.on_batch_complete(5)
    assert timer.epoch == 1
    assert timer.batch == 2
    assert timer.batch_in_epoch == 1
    assert timer.sample == 15
    assert timer.sample_in_epoch == 5
    assert timer.token == 20
    assert timer.token_in_epoch == 0


def test_in_epoch_counters_reset_at_each_epoch_and_are_saved() -> None:
    timer = Timer()
    timer.on_batch_complete(samples=8, tokens=100)
    timer.on_batch_complete(samples=8, tokens=50)
    assert (timer.sample_in_epoch, timer.token_in_epoch) == (Time(16, "sp"), Time(150, "tok"))
    timer.on_epoch_complete()
    assert (timer.sample_in_epoch, timer.token_in_epoch) == (Time(0, "sp"), Time(0, "tok"))
    timer.on_batch_complete(samples=3, tokens=7)
    saved = timer.state_dict()
    assert (saved["sample_in_epoch"], saved["token_in_epoch"]) == (3, 7)
    assert (saved["sample"], saved["token"]) == (19, 157)


def test_timers_with_the_same_counters_are_equal() -> None:
    first, second = Timer(), Timer()
    assert first == second
    first.on_batch_complete(samples=4)
    assert first != second
    second.on_batch_complete(samples=4)
    assert first == second
    second.on_batch_complete(samples=0)
    assert first != second


def test_a_timer_compares_with_a_time_in_that_times_unit() -> None:
    assert Timer() == Time(0, "ep")
    assert Timer() < Time(5, "ep")
    timer = Timer()
    for _ in range(3):
        timer.on_batch_complete(samples=4, tokens=10)
    assert timer == Time(3, "ba") and timer == Time(12, "sp") and timer == Time(30, "tok") and timer == Time(0, "ep")
    assert timer != Time(4, "ba")
    assert timer > Time(2, "ba") and timer >= Time(3, "ba") and timer <= Time(12, "sp") and timer < Time(31, "tok")
    assert not timer < Time(3, "ba")
    assert Time(5, "ba") > timer  # the reflected comparison goes through the timer too


def test_a_timer_compared_with_a_duration_points_to_elapsed_duration() -> None:
    with pytest.raises(ValueError, match="get_elapsed_duration"):
        _ = Timer() < Time(0.5, "dur")


def test_a_timer_is_not_a_number_and_is_unhashable() -> None:
    assert Timer() != 0
    with pytest.raises(TypeError):
        _ = Timer() < 5  # type: ignore[operator]
    with pytest.raises(TypeError, match="unhashable"):
        hash(Timer())


# --- 3. Interchange with Composer ------------------------------------------------------------------------------


def _spot_timer() -> Timer:
    timer = Timer()
    for _ in range(3):
        timer.on_batch_complete(samples=8, tokens=100)
    timer.on_epoch_complete()
    timer.on_batch_complete(samples=8, tokens=40)
    return timer


def test_a_spot_trainer_timer_loads_into_composer() -> None:
    saved = save_and_load(_spot_timer().state_dict())  # through a weights_only checkpoint
    composer = ComposerV06Timer()
    composer.load_state_dict(saved)
    assert composer.counters == {
        "epoch": 1,
        "batch": 4,
        "sample": 32,
        "token": 340,
        "batch_in_epoch": 1,
        "sample_in_epoch": 8,
        "token_in_epoch": 40,
    }


def test_the_old_spot_trainer_timer_is_what_composer_could_not_load() -> None:
    added = ("sample_in_epoch", "token_in_epoch")
    old = {key: value for key, value in _spot_timer().state_dict().items() if key not in added}
    with pytest.raises(KeyError, match="sample_in_epoch"):
        ComposerV06Timer().load_state_dict(old)


def test_a_composer_timer_loads_here_and_saves_back_unchanged() -> None:
    composer = ComposerV06Timer()
    for samples, tokens in ((8, 100), (8, 100), (6, 90)):
        composer.on_batch_complete(samples, tokens)
    composer.on_epoch_complete()
    composer.on_batch_complete(8, 30)
    timer = Timer()
    timer.load_state_dict(save_and_load(composer.state_dict()))
    assert (timer.epoch, timer.batch, timer.sample, timer.token) == (
        Time(1, "ep"), Time(4, "ba"), Time(30, "sp"), Time(320, "tok"),
    )
    assert (timer.batch_in_epoch, timer.sample_in_epoch, timer.token_in_epoch) == (
        Time(1, "ba"), Time(8, "sp"), Time(30, "tok"),
    )
    assert timer.state_dict() == composer.state_dict()
    assert list(timer.state_dict()) == list(TIMER_KEYS)


@pytest.mark.parametrize(
    ("batches_before", "batches_now", "expected"),
    [
        (0, 0, (0, 0)),  # nothing trained
        (3, 0, (0, 0)),  # at an epoch boundary: exact
        (0, 2, (16, 200)),  # first epoch: everything so far is in it
        (3, 2, (16, 200)),  # later epochs: equal batches assumed (exact here)
    ],
)
def test_an_older_spot_trainer_timer_still_loads(
    batches_before: int, batches_now: int, expected: tuple[int, int]
) -> None:
    source = Timer()
    for _ in range(batches_before):
        source.on_batch_complete(samples=8, tokens=100)
    if batches_before:
        source.on_epoch_complete()
    for _ in range(batches_now):
        source.on_batch_complete(samples=8, tokens=100)
    old = {key: source.state_dict()[key] for key in ("epoch", "batch", "sample", "token", "batch_in_epoch")}
    timer = Timer()
    timer.load_state_dict(old)
    assert (timer.sample_in_epoch.value, timer.token_in_epoch.value) == expected
    assert timer.state_dict() == source.state_dict()


def test_a_derived_in_epoch_count_is_logged_as_an_assumption(caplog: pytest.LogCaptureFixture) -> None:
    old = {"epoch": 2, "batch": 10, "sample": 70, "token": 0, "batch_in_epoch": 3}
    timer = Timer()
    with caplog.at_level(logging.INFO, logger="state.time"):
        timer.load_state_dict(old)
    assert timer.sample_in_epoch == Time(21, "sp")
    assert "no sample_in_epoch" in caplog.text and "assuming equal batches" in caplog.text


@pytest.mark.parametrize(
    ("key", "value", "error"), [("sample_in_epoch", 1.5, TypeError), ("token_in_epoch", -1, ValueError)]
)
def test_bad_new_counters_are_refused_and_the_timer_is_unchanged(key: str, value: object, error: type) -> None:
    timer = _spot_timer()
    before = timer.state_dict()
    bad = {**dict.fromkeys(TIMER_KEYS, 0), key: value}
    with pytest.raises(error, match=key):
        timer.load_state_dict(bad)
    assert timer.state_dict() == before


def test_the_original_counters_are_still_required() -> None:
    with pytest.raises(StateError, match="missing batch_in_epoch"):
        Timer().load_state_dict({"epoch": 0, "batch": 0, "sample": 0, "token": 0, "sample_in_epoch": 0})


def test_a_state_checkpoint_timer_loads_into_composer(make_setup: MakeSetup) -> None:
    setup = make_setup()
    train(setup, 8)  # 6 batches an epoch: into the second epoch
    saved = save_and_load(setup.state.state_dict())
    composer = ComposerV06Timer()
    composer.load_state_dict(saved["timer"]["Timer"])
    assert composer.counters["batch_in_epoch"] == 2 and composer.counters["sample_in_epoch"] == 8
    assert composer.counters["epoch"] == 1 and composer.counters["sample"] == 32


def _composer_checkpoint(
    make_setup: MakeSetup, version: str, ddp_prefixed: bool = False
) -> tuple[Any, dict[str, Any]]:
    """A trained setup and the "state" entry Composer ``version`` would have saved for it."""
    source = make_setup(seed=3)
    train(source, 5)
    composer_timer = ComposerV06Timer()
    for _ in range(5):
        composer_timer.on_batch_complete(samples=4)
    state = source.state
    saved = composer_state_dict(
        version, state.model, state.optimizers[0], state.schedulers[0], composer_timer, 3, ddp_prefixed=ddp_prefixed
    )
    return source, save_and_load(saved)


def _load_expecting_only(target: Any, saved: dict[str, Any], absent: set[str]) -> None:
    """Composer does not save spot-trainer's additions; each absent one warns and nothing else does."""
    with pytest.warns(UserWarning) as record:
        target.load_state_dict(saved)
    messages = [str(warning.message) for warning in record]
    warned = {name for name in ("train_metrics", "rng", "current_metrics") if any(name in m for m in messages)}
    assert warned == absent
    assert len(record) == len(absent)


@pytest.mark.parametrize(("version", "ddp_prefixed"), [("v0.6", False), ("v0.5", False), ("v0.5", True)])
def test_a_composer_state_checkpoint_loads(make_setup: MakeSetup, version: str, ddp_prefixed: bool) -> None:
    source, saved = _composer_checkpoint(make_setup, version, ddp_prefixed)
    target = make_setup(seed=9).state
    absent = {"train_metrics", "rng"} | ({"current_metrics"} if version == "v0.5" else set())
    _load_expecting_only(target, saved, absent)
    assert_nested_equal(target.model.state_dict(), source.state.model.state_dict())
    assert_nested_equal(target.optimizers[0].state_dict(), source.state.optimizers[0].state_dict())
    assert target.schedulers[0].state_dict() == source.state.schedulers[0].state_dict()
    assert target.timer == source.state.timer
    assert target.timer.sample_in_epoch == Time(20, "sp")
    assert target.rank_zero_seed == 3
    if version == "v0.6":
        assert target.current_metrics == {"train": {"Accuracy": 0.5}}


def test_a_composer_checkpoint_from_before_v0_4_1_loads(make_setup: MakeSetup) -> None:
    """Composer's own tolerance: leading underscores and _is_model_ddp_wrapped (its v0.4.1 renames)."""
    source, saved = _composer_checkpoint(make_setup, "v0.5", ddp_prefixed=True)
    old = {("_is_model_ddp_wrapped" if key == "is_model_ddp" else f"_{key}"): value for key, value in saved.items()}
    target = make_setup(seed=9).state
    _load_expecting_only(target, old, {"train_metrics", "rng", "current_metrics"})
    assert_nested_equal(target.model.state_dict(), source.state.model.state_dict())
    assert target.timer == source.state.timer


def test_a_spot_trainer_checkpoint_without_the_new_timer_keys_loads(make_setup: MakeSetup) -> None:
    source = make_setup()
    train(source, 8)
    saved = save_and_load(source.state.state_dict())
    for key in ("sample_in_epoch", "token_in_epoch"):
        del saved["timer"]["Timer"][key]
    target = make_setup(seed=1).state
    target.load_state_dict(saved)
    assert target.timer == source.state.timer
    assert isinstance(saved["rng"], dict) and torch.equal(torch.get_rng_state(), saved["rng"]["torch"])


# --- 5. Precision: refused at construction (the deliberate difference), unless a factory decides ----------


def test_amp_without_cuda_is_refused_before_any_forward_pass(
    make_setup: MakeSetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PrecisionError, match="amp_fp16 needs a CUDA GPU"):
        make_setup(precision="amp_fp16")


def test_a_custom_precision_factory_gets_composers_behaviour(
    make_setup: MakeSetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With its own factory, a State accepts AMP on CPU and the factory fails when the context is entered."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def composer_like(precision: Precision) -> Any:
        if precision is not Precision.FP32:
            raise AssertionError("Precision AMP is only available when `torch.cuda.is_available() == True`.")
        return contextlib.nullcontext()

    state = make_setup(precision="amp_fp16", precision_context=composer_like).state
    assert state.precision is Precision.AMP_FP16
    with pytest.raises(AssertionError, match="only available"):
        _ = state.precision_context
