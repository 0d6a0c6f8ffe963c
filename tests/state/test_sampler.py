"""ResumableBatchSampler: deterministic per (seed, epoch), resumable without reading skipped batches."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from state import GlobalBatchSampler, ResumableBatchSampler


def _epoch(sampler: ResumableBatchSampler, epoch: int, start_batch: int = 0) -> list[list[int]]:
    sampler.set_epoch(epoch, start_batch)
    return list(sampler)


def test_same_seed_and_epoch_give_the_same_order() -> None:
    assert _epoch(ResumableBatchSampler(50, 5, seed=1), 3) == _epoch(ResumableBatchSampler(50, 5, seed=1), 3)


@pytest.mark.parametrize(("seed", "epoch"), [(1, 4), (2, 3)], ids=["other-epoch", "other-seed"])
def test_other_epoch_or_seed_gives_another_order(seed: int, epoch: int) -> None:
    assert _epoch(ResumableBatchSampler(50, 5, seed=seed), epoch) != _epoch(ResumableBatchSampler(50, 5, seed=1), 3)


def test_an_epoch_is_a_permutation_of_the_dataset() -> None:
    batches = _epoch(ResumableBatchSampler(40, 8, seed=0), 0)
    assert len(batches) == 5 and all(len(batch) == 8 for batch in batches)
    assert sorted(index for batch in batches for index in batch) == list(range(40))
    assert all(isinstance(index, int) for batch in batches for index in batch)


def test_no_shuffle_is_in_order() -> None:
    assert _epoch(ResumableBatchSampler(6, 2, seed=0, shuffle=False), 5) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("start_batch", [0, 1, 4, 6])
def test_start_batch_yields_exactly_the_tail_of_the_epoch(start_batch: int) -> None:
    sampler = ResumableBatchSampler(26, 4, seed=9)
    full = _epoch(sampler, 2)
    assert _epoch(sampler, 2, start_batch) == full[start_batch:]
    assert len(sampler) == 6  # len is always the full epoch, wherever iteration starts


@pytest.mark.parametrize(("drop_last", "batches", "last_size"), [(True, 3, 4), (False, 4, 2)])
def test_drop_last_controls_the_partial_batch(drop_last: bool, batches: int, last_size: int) -> None:
    sampler = ResumableBatchSampler(14, 4, seed=0, drop_last=drop_last)
    epoch = _epoch(sampler, 0)
    assert len(sampler) == len(epoch) == batches
    assert len(epoch[-1]) == last_size


def _rank_indices(num_samples: int, replicas: int, **kwargs: Any) -> list[list[int]]:
    return [
        [
            index
            for batch in _epoch(
                ResumableBatchSampler(num_samples, 2, seed=5, num_replicas=replicas, rank=rank, **kwargs), 1
            )
            for index in batch
        ]
        for rank in range(replicas)
    ]


def test_ranks_partition_the_data() -> None:
    per_rank = _rank_indices(24, 3)
    assert all(len(indices) == 8 for indices in per_rank)
    assert sorted(index for indices in per_rank for index in indices) == list(range(24))


def test_uneven_data_is_padded_so_every_rank_runs_the_same_batches() -> None:
    per_rank = _rank_indices(10, 4, drop_last=False)  # padded to 12: two samples are seen twice
    assert [len(indices) for indices in per_rank] == [3, 3, 3, 3]
    counts = Counter(index for indices in per_rank for index in indices)
    assert set(counts) == set(range(10))
    assert sorted(counts.values()) == [1] * 8 + [2] * 2


def test_ranks_slice_the_same_permutation() -> None:
    whole = [index for batch in _epoch(ResumableBatchSampler(12, 1, seed=5), 1) for index in batch]
    per_rank = _rank_indices(12, 3)
    assert [whole[rank::3] for rank in range(3)] == per_rank


def test_iteration_never_touches_the_global_torch_rng() -> None:
    sampler = ResumableBatchSampler(100, 7, seed=3)
    before = torch.get_rng_state()
    _epoch(sampler, 0)
    _epoch(sampler, 1, start_batch=5)
    assert torch.equal(torch.get_rng_state(), before)


def test_works_as_a_dataloader_batch_sampler() -> None:
    dataset = TensorDataset(torch.arange(20) * 10)
    sampler = ResumableBatchSampler(20, 5, seed=2)
    sampler.set_epoch(1, start_batch=2)
    expected = [[index * 10 for index in batch] for batch in list(sampler)]
    loaded = [batch[0].tolist() for batch in DataLoader(dataset, batch_sampler=sampler)]
    assert loaded == expected and len(loaded) == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"num_samples": 0}, ValueError, "num_samples must be >= 1"),
        ({"num_replicas": 0}, ValueError, "num_replicas must be >= 1"),
        ({"rank": 2, "num_replicas": 2}, ValueError, r"rank must be in \[0, num_replicas=2\)"),
        ({"rank": -1}, ValueError, "rank must be >= 0"),
        ({"batch_size": 11}, ValueError, "leaves no batch"),
        ({"seed": "1"}, TypeError, "seed must be an int"),
    ],
)
def test_constructor_validates(kwargs: dict[str, Any], error: type, message: str) -> None:
    arguments: dict[str, Any] = {"num_samples": 10, "batch_size": 2, "seed": 0, **kwargs}
    with pytest.raises(error, match=message):
        ResumableBatchSampler(**arguments)


@pytest.mark.parametrize(
    ("epoch", "start_batch", "message"),
    [(-1, 0, "epoch must be >= 0"), (0, -1, "start_batch must be >= 0"), (0, 6, r"start_batch must be in \[0, 5\]")],
)
def test_set_epoch_validates(epoch: int, start_batch: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ResumableBatchSampler(10, 2, seed=0).set_epoch(epoch, start_batch)


# -- GlobalBatchSampler (issue 17): the global batch is the unit, whatever the number of ranks ------------


def _global_batches(num_samples: int, global_batch: int, world: int, epoch: int = 2) -> list[list[int]]:
    """Global batch b as the union of every rank's slice of it, in rank-slice order."""
    per_rank = []
    for rank in range(world):
        sampler = GlobalBatchSampler(num_samples, global_batch, seed=11, num_replicas=world, rank=rank)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    return [sorted(i for rank in range(world) for i in per_rank[rank][b]) for b in range(len(per_rank[0]))]


@pytest.mark.parametrize("num_samples", [3072, 1000, 97])
def test_each_global_batch_is_the_same_whatever_the_number_of_ranks(num_samples: int) -> None:
    one = _global_batches(num_samples, 24, 1)
    assert len(one) == num_samples // 24
    for world in (2, 3, 4, 6, 8):
        assert _global_batches(num_samples, 24, world) == one


def test_switching_rank_counts_mid_epoch_trains_every_sample_exactly_once() -> None:
    seen: list[int] = []
    steps = 1000 // 24
    for world, (start, stop) in ((2, (0, 10)), (1, (10, 25)), (3, (25, steps))):
        for rank in range(world):
            sampler = GlobalBatchSampler(1000, 24, seed=11, num_replicas=world, rank=rank)
            sampler.set_epoch(0, start)
            seen += [i for batch in list(sampler)[: stop - start] for i in batch]
    assert len(seen) == len(set(seen)) == steps * 24  # the remainder (1000 % 24) is dropped, as drop_last does


@pytest.mark.parametrize(("num_samples", "batch", "world"), [(3072, 64, 2), (100, 5, 3), (10, 1, 3), (97, 4, 4)])
def test_the_rank_strided_scheme_is_kept_for_its_old_checkpoints(num_samples: int, batch: int, world: int) -> None:
    for rank in range(world):
        old = ResumableBatchSampler(num_samples, batch, seed=5, num_replicas=world, rank=rank)
        new = GlobalBatchSampler(num_samples, batch * world, seed=5, num_replicas=world, rank=rank, wrap_pad=True)
        old.set_epoch(3, 1)
        new.set_epoch(3, 1)
        assert list(new) == list(old) and len(new) == len(old)
        if num_samples % world == 0:  # no padding: the new scheme is the old one exactly
            plain = GlobalBatchSampler(num_samples, batch * world, seed=5, num_replicas=world, rank=rank)
            plain.set_epoch(3, 1)
            assert list(plain) == list(old)


def test_a_global_batch_must_divide_among_the_ranks() -> None:
    with pytest.raises(ValueError, match="does not divide among 5 ranks"):
        GlobalBatchSampler(1000, 24, seed=1, num_replicas=5)
