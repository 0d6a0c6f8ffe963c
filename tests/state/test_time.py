"""Time, TimeUnit and Timer: units are explicit and never silently mixed."""

from __future__ import annotations

import pytest

from state import StateError, Time, Timer, TimeUnit


@pytest.mark.parametrize(
    ("text", "value", "unit"),
    [
        ("10ep", 10, TimeUnit.EPOCH),
        ("500ba", 500, TimeUnit.BATCH),
        ("2048sp", 2048, TimeUnit.SAMPLE),
        ("1e6tok", 1_000_000, TimeUnit.TOKEN),
        ("2.0ep", 2, TimeUnit.EPOCH),
        ("0.5dur", 0.5, TimeUnit.DURATION),
        ("1dur", 1.0, TimeUnit.DURATION),
        ("  7 ba \n", 7, TimeUnit.BATCH),
        ("3EP", 3, TimeUnit.EPOCH),
    ],
)
def test_from_timestring_parses(text: str, value: float, unit: TimeUnit) -> None:
    parsed = Time.from_timestring(text)
    assert parsed.unit is unit
    assert parsed.value == value
    expected_type = float if unit is TimeUnit.DURATION else int
    assert type(parsed.value) is expected_type


@pytest.mark.parametrize("text", ["", "ep", "10", "10 epochs", "10min", "-1ep", "1.5.ep", "inf ep", "nanba", "1e6"])
def test_from_timestring_rejects_garbage_quoting_it_and_listing_units(text: str) -> None:
    with pytest.raises(ValueError, match=r"invalid time string .*ep, ba, sp, tok, dur") as error:
        Time.from_timestring(text)
    assert repr(text) in str(error.value)


@pytest.mark.parametrize("text", ["1.5ep", "2.25ba", "0.5sp", "1.5e0tok"])
def test_from_timestring_rejects_fractional_counts(text: str) -> None:
    with pytest.raises(ValueError, match="whole numbers"):
        Time.from_timestring(text)


def test_from_timestring_rejects_non_strings() -> None:
    with pytest.raises(TypeError, match="must be a str"):
        Time.from_timestring(10)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("factory", "unit"),
    [
        (Time.from_epoch, TimeUnit.EPOCH),
        (Time.from_batch, TimeUnit.BATCH),
        (Time.from_sample, TimeUnit.SAMPLE),
        (Time.from_token, TimeUnit.TOKEN),
        (Time.from_duration, TimeUnit.DURATION),
    ],
)
def test_classmethod_constructors_set_the_unit(factory: object, unit: TimeUnit) -> None:
    made = factory(3)  # type: ignore[operator]
    assert (made.value, made.unit) == (3, unit)


def test_unit_accepts_its_string_and_rejects_unknown_with_the_list() -> None:
    assert TimeUnit("ba") is TimeUnit.BATCH
    assert Time(3, "tok").unit is TimeUnit.TOKEN
    with pytest.raises(ValueError, match="valid units: ep, ba, sp, tok, dur"):
        TimeUnit("min")


@pytest.mark.parametrize("value", ["3", None, True])
def test_time_value_must_be_a_number(value: object) -> None:
    with pytest.raises(TypeError, match="int or float"):
        Time(value, TimeUnit.EPOCH)  # type: ignore[type-var]


def test_arithmetic_with_same_unit_and_numbers() -> None:
    five = Time(5, TimeUnit.BATCH)
    assert five + Time(2, "ba") == Time(7, "ba")
    assert five - Time(2, "ba") == Time(3, "ba")
    assert five + 1 == Time(6, "ba")
    assert 1 + five == Time(6, "ba")
    assert five - 1 == Time(4, "ba")
    assert 10 - five == Time(5, "ba")
    assert (five + 1).unit is TimeUnit.BATCH


@pytest.mark.parametrize("operation", [lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a < b, lambda a, b: a / b])
def test_mixing_units_raises_a_clear_type_error(operation: object) -> None:
    with pytest.raises(TypeError, match=r"cannot \w+ 5ep and 5ba: the units differ"):
        operation(Time(5, "ep"), Time(5, "ba"))  # type: ignore[operator]


def test_comparisons_with_time_and_numbers() -> None:
    three = Time(3, "ep")
    assert three < Time(4, "ep") and three <= Time(3, "ep") and three > Time(2, "ep") and three >= 3
    assert three < 3.5 and not three > 3
    assert three == 3 and three != 4
    assert three == Time(3.0, "ep")


def test_different_units_are_unequal_rather_than_an_error() -> None:
    assert Time(3, "ep") != Time(3, "ba")
    assert len({Time(3, "ep"), Time(3, "ba"), Time(3, "ep")}) == 2


def test_division_gives_a_float_duration() -> None:
    half = Time(5, "ba") / Time(10, "ba")
    assert half.unit is TimeUnit.DURATION
    assert half.value == 0.5 and isinstance(half.value, float)


def test_str_is_the_timestring_and_round_trips() -> None:
    assert str(Time(10, "ep")) == "10ep"
    assert str(Time(0.25, "dur")) == "0.25dur"
    for time in (Time(10, "ep"), Time(1_000_000, "tok"), Time(0.25, "dur")):
        assert Time.from_timestring(str(time)) == time


def test_repr_and_hash() -> None:
    assert repr(Time(10, "ep")) == "Time(10, TimeUnit.EPOCH)"
    assert {Time(10, "ep"): "x"}[Time(10, "ep")] == "x"


def test_time_is_immutable() -> None:
    time = Time(1, "ep")
    with pytest.raises(AttributeError):
        time.value = 2  # type: ignore[misc]


# --- Timer ---------------------------------------------------------------------------------------------------


def _advanced_timer() -> Timer:
    timer = Timer()
    for _ in range(3):
        timer.on_batch_complete(samples=8, tokens=100)
    timer.on_epoch_complete()
    timer.on_batch_complete(samples=5)
    return timer


def test_timer_starts_at_zero_in_every_unit() -> None:
    timer = Timer()
    for name, unit in [
        ("epoch", TimeUnit.EPOCH),
        ("batch", TimeUnit.BATCH),
        ("sample", TimeUnit.SAMPLE),
        ("token", TimeUnit.TOKEN),
        ("batch_in_epoch", TimeUnit.BATCH),
    ]:
        assert getattr(timer, name) == Time(0, unit)


def test_timer_counts_batches_and_epochs() -> None:
    timer = _advanced_timer()
    assert timer.epoch == Time(1, "ep")
    assert timer.batch == Time(4, "ba")
    assert timer.batch_in_epoch == Time(1, "ba")
    assert timer.sample == Time(29, "sp")
    assert timer.token == Time(300, "tok")


@pytest.mark.parametrize(("unit", "expected"), [("ep", 1), ("ba", 4), (TimeUnit.SAMPLE, 29), ("tok", 300)])
def test_timer_get_by_unit(unit: object, expected: int) -> None:
    got = _advanced_timer().get(unit)  # type: ignore[arg-type]
    assert got == Time(expected, TimeUnit(unit))


def test_timer_get_refuses_duration() -> None:
    with pytest.raises(ValueError, match="get_elapsed_duration"):
        Timer().get(TimeUnit.DURATION)


@pytest.mark.parametrize(
    ("samples", "tokens", "error"), [(-1, 0, ValueError), (1, -5, ValueError), (1.5, 0, TypeError)]
)
def test_timer_rejects_bad_counts(samples: object, tokens: object, error: type) -> None:
    with pytest.raises(error):
        Timer().on_batch_complete(samples, tokens)  # type: ignore[arg-type]


def test_timer_state_dict_is_plain_ints_and_round_trips() -> None:
    saved = _advanced_timer().state_dict()
    assert saved == {
        "epoch": 1,
        "batch": 4,
        "sample": 29,
        "token": 300,
        "batch_in_epoch": 1,
        "sample_in_epoch": 5,
        "token_in_epoch": 0,
    }
    assert all(type(value) is int for value in saved.values())
    restored = Timer()
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved
    assert restored.batch_in_epoch == Time(1, "ba")


def test_timer_load_refuses_incomplete_state_and_stays_unchanged() -> None:
    timer = _advanced_timer()
    before = timer.state_dict()
    with pytest.raises(StateError, match="missing batch_in_epoch"):
        timer.load_state_dict({"epoch": 9, "batch": 9, "sample": 9, "token": 9})
    assert timer.state_dict() == before
