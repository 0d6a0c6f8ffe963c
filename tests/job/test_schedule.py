"""Intervals, and `dur` intervals as fractions of --max-duration (issue 20, point 4)."""
from __future__ import annotations

import math

import pytest

from job.schedule import Interval
from uploader.local import list_committed
from state import Time, Timer


def test_a_dur_interval_parses_as_a_fraction() -> None:
    interval = Interval.parse("0.1dur")
    assert interval.fraction == 0.1 and interval.every is None and interval.seconds is None
    assert str(interval) == "0.1dur"


@pytest.mark.parametrize("text", ["0dur", "1.5dur", "0.0dur"])
def test_a_fraction_outside_0_to_1_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="more than 0 and at most 1"):
        Interval.parse(text)


@pytest.mark.parametrize(
    ("text", "max_duration", "steps_per_epoch", "global_batch", "expected"),
    [
        ("0.25dur", "12ep", None, None, Time(3, "ep")),  # whole epochs stay epochs, without the data
        ("0.1dur", "30ep", None, None, Time(3, "ep")),  # 0.1 * 30 is 3.0000000000000004
        ("1dur", "12ep", 100, 64, Time(12, "ep")),
        ("0.1dur", "12ep", 10, None, Time(12, "ba")),  # 1.2 epochs of 10 batches
        ("0.1dur", "12ep", 7, None, Time(8, "ba")),  # 8.4 batches: the nearest whole number
        ("0.1dur", "30ba", None, None, Time(3, "ba")),
        ("0.05dur", "30ba", None, None, Time(2, "ba")),  # 1.5 rounds up
        ("0.5dur", "6400sp", None, 64, Time(50, "ba")),
    ],
)
def test_resolve_gives_batches_or_epochs(
    text: str, max_duration: str, steps_per_epoch: int | None, global_batch: int | None, expected: Time
) -> None:
    resolved = Interval.parse(text).resolve(Time.from_timestring(max_duration), steps_per_epoch, global_batch)
    assert resolved == Interval(every=expected)
    assert resolved.every is not None and type(resolved.every.value) is int


@pytest.mark.parametrize(("text", "max_duration"), [("0.1dur", "12ep"), ("0.5dur", "6400sp")])
def test_resolve_waits_for_what_it_needs(text: str, max_duration: str) -> None:
    interval = Interval.parse(text)
    assert interval.resolve(Time.from_timestring(max_duration)) is interval


@pytest.mark.parametrize(
    ("text", "max_duration", "steps_per_epoch", "global_batch"),
    [("0.01dur", "30ba", None, None), ("0.01dur", "12ep", 4, None), ("0.001dur", "6400sp", None, 64)],
)
def test_an_interval_of_less_than_a_batch_is_refused(
    text: str, max_duration: str, steps_per_epoch: int | None, global_batch: int | None
) -> None:
    with pytest.raises(ValueError, match=rf"{text} of --max-duration {max_duration} is .* less than one"):
        Interval.parse(text).resolve(Time.from_timestring(max_duration), steps_per_epoch, global_batch)


def test_a_token_max_duration_cannot_resolve_a_fraction() -> None:
    with pytest.raises(ValueError, match="tokens per batch are not known"):
        Interval.parse("0.5dur").resolve(Time(10_000, "tok"), 10, 64)


@pytest.mark.parametrize("text", ["10ba", "2ep", "90s"])
def test_other_intervals_resolve_to_themselves(text: str) -> None:
    interval = Interval.parse(text)
    assert interval.resolve(Time(12, "ep"), 10, 64) is interval


def test_another_max_duration_gives_another_interval() -> None:
    """What a resume with another --max-duration gets: the fraction of the new one."""
    interval = Interval.parse("0.25dur")
    assert interval.resolve(Time(12, "ep")).every == Time(3, "ep")
    assert interval.resolve(Time(20, "ep")).every == Time(5, "ep")


def test_a_resolved_fraction_is_due_like_its_batches() -> None:
    interval = Interval.parse("0.1dur").resolve(Time(12, "ep"), steps_per_epoch=10)
    timer, due = Timer(), []
    for _ in range(36):
        timer.on_batch_complete(samples=1)
        due.append(interval.due(timer, epoch_ended=False, elapsed_seconds=0.0))
    assert [step for step, is_due in enumerate(due, start=1) if is_due] == [12, 24, 36]


def test_an_unresolved_fraction_is_never_silently_due() -> None:
    with pytest.raises(RuntimeError, match="never resolved"):
        Interval.parse("0.1dur").due(Timer(), epoch_ended=True, elapsed_seconds=0.0)


def test_a_fraction_of_an_epoch_checkpoints_on_its_batches_in_a_real_run(tiny_config, ckpt_dir) -> None:
    """0.25dur of 2ep is half an epoch: known only once the data is built (job.app resolves it then)."""
    from tests.support.jobs import ckpt_config, train_state

    state = train_state(tiny_config(max_duration="2ep"),
                        ckpt_config(ckpt_dir, interval="0.25dur", keep=100, async_save=False))
    total = 2 * state.steps_per_epoch
    every = math.floor(state.steps_per_epoch / 2 + 0.5)
    assert state.timer.batch.value == total
    assert [c.step for c in list_committed(ckpt_dir)] == sorted({*range(every, total + 1, every), total})


def test_a_fraction_under_one_batch_of_this_data_is_a_config_error(tiny_config, ckpt_dir) -> None:
    from job.exceptions import ConfigError
    from tests.support.jobs import ckpt_config, train_state

    with pytest.raises(ConfigError, match=r"--save-interval 0.001dur of --max-duration 1ep is .* less than one"):
        train_state(tiny_config(max_duration="1ep"), ckpt_config(ckpt_dir, interval="0.001dur"))
    assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir())
