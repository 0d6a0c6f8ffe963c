"""bench.common's schedule: the orders the arms run in are what makes a side-by-side ratio fair."""
from __future__ import annotations

from collections import Counter

import pytest

from bench.common import balanced_orders, by_predecessor, interleaved


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_every_arm_takes_every_position_and_follows_every_other_equally_often(n):
    orders = balanced_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    positions = Counter((position, arm) for order in orders for position, arm in enumerate(order))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    follows = Counter((order[i - 1], order[i]) for order in orders for i in range(1, n))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1


@pytest.mark.parametrize("n", [3, 4, 5, 6, 7])
def test_no_arm_follows_itself_across_rounds_and_no_boundary_repeats(n):
    orders = balanced_orders(n)
    boundaries = [(orders[i][-1], orders[(i + 1) % len(orders)][0]) for i in range(len(orders))]
    assert all(last != first for last, first in boundaries)
    assert len(set(boundaries)) == len(boundaries)


def test_three_arms_run_as_one_sequence_follow_each_other_equally_often():
    sequence = [arm for order in balanced_orders(3) for arm in order]
    follows = Counter((sequence[i - 1], sequence[i]) for i in range(len(sequence)))  # cyclic: i = 0 wraps
    assert follows == {(a, b): 3 for a in range(3) for b in range(3) if a != b}


def test_two_arms_alternate():
    assert balanced_orders(2) == [[0, 1], [1, 0]]


def test_interleaved_runs_the_cycle_of_orders_and_drops_the_warm_up():
    ran: list[str] = []

    def arm(name: str):
        def run() -> int:
            ran.append(name)
            return len(ran)
        return run

    results = interleaved({name: arm(name) for name in "abc"}, rounds=6, warmup=1)
    assert len(ran) == 21
    rounds = ["".join(ran[i:i + 3]) for i in range(0, 21, 3)]
    assert rounds == ["abc", "bca", "cab", "cba", "bac", "acb", "abc"]
    assert {name: len(values) for name, values in results.items()} == {"a": 6, "b": 6, "c": 6}
    assert results["a"][0] == 6  # "a" ran first in the warm-up round (1, dropped), then 6th


def test_each_value_is_grouped_by_the_arm_that_ran_just_before_it():
    after: dict[str, list[str]] = {}
    calls = iter(range(100))
    results = interleaved({name: lambda: float(next(calls)) for name in "ab"}, rounds=4, after=after)
    # a b | b a | a b | b a: values 0 1 | 2 3 | 4 5 | 6 7
    assert after == {"a": ["", "b", "a", "b"], "b": ["a", "b", "a", "b"]}
    assert by_predecessor(results, after) == {"a": {"": 0.0, "a": 4.0, "b": 5.0}, "b": {"a": 3.0, "b": 4.0}}
