"""A batch sampler that can resume mid-epoch by skipping batches arithmetically instead of reading them."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from state.display import brief

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of one epoch's permutation.

    Mixed rather than ``seed + epoch`` so that (seed 1, epoch 0) and (seed 0, epoch 1) do not share an order.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ epoch)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """One epoch's order of the dataset's indices, from a private generator (the global RNG is untouched)."""
    if not shuffle:
        return torch.arange(num_samples)
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch)))


def wrapped(order: torch.Tensor, size: int) -> torch.Tensor:
    """``order`` padded to ``size`` by wrapping around (as DistributedSampler pads), or as it is."""
    if size <= len(order):
        return order
    return order.repeat(-(-size // len(order)))[:size]


class ResumableBatchSampler:
    """Yields lists of dataset indices for ``DataLoader(batch_sampler=...)``.

    Each epoch's order is a pure function of (seed, epoch), computed with a private ``torch.Generator``: the
    global torch RNG is never touched, so a run resumed from a checkpoint draws the same dropout and
    augmentation numbers as one that was never interrupted. ``set_epoch(epoch, start_batch)`` then starts
    at the first unseen batch without loading the ones before it.

    With ``num_replicas > 1`` the permutation is padded (by wrapping around) to a multiple of the replica
    count and rank ``r`` takes ``perm[r::num_replicas]``, as ``DistributedSampler`` does, so every rank runs
    the same number of batches and no collective waits forever.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        _check_int("num_samples", num_samples, minimum=1)
        _check_int("batch_size", batch_size, minimum=1)
        _check_int("seed", seed)
        _check_int("num_replicas", num_replicas, minimum=1)
        _check_int("rank", rank, minimum=0)
        if rank >= num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.start_batch = 0
        self._samples_per_rank = -(-num_samples // num_replicas)
        if drop_last and self._samples_per_rank < batch_size:
            raise ValueError(
                f"batch_size={batch_size} with drop_last=True leaves no batch: each of {num_replicas} replica(s) "
                f"gets only {self._samples_per_rank} of {num_samples} samples"
            )

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch to iterate and the batch to start at (the timer's ``batch_in_epoch`` on resume)."""
        _check_int("epoch", epoch, minimum=0)
        _check_int("start_batch", start_batch, minimum=0)
        if start_batch > len(self):
            raise ValueError(f"start_batch must be in [0, {len(self)}] (batches per epoch), got {start_batch}")
        self.epoch = epoch
        self.start_batch = start_batch

    def _rank_indices(self) -> torch.Tensor:
        order = wrapped(epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle),
                        self._samples_per_rank * self.num_replicas)
        return order[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[list[int]]:
        indices = self._rank_indices()
        for batch in range(self.start_batch, len(self)):
            yield indices[batch * self.batch_size : (batch + 1) * self.batch_size].tolist()

    def __len__(self) -> int:
        if self.drop_last:
            return self._samples_per_rank // self.batch_size
        return -(-self._samples_per_rank // self.batch_size)

    def __repr__(self) -> str:
        return (
            f"ResumableBatchSampler(num_samples={self.num_samples}, batch_size={self.batch_size}, seed={self.seed}, "
            f"shuffle={self.shuffle}, drop_last={self.drop_last}, num_replicas={self.num_replicas}, "
            f"rank={self.rank}, epoch={self.epoch}, start_batch={self.start_batch})"
        )


def _check_int(name: str, value: object, minimum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {brief(value, 40)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


class GlobalBatchSampler:
    """Yields this rank's slice of each *global* batch, for ``DataLoader(batch_sampler=...)``: elastic.

    Each epoch's order is the same seeded permutation as :class:`ResumableBatchSampler`'s, cut into global
    batches of ``global_batch`` samples (the remainder dropped); global batch ``b`` is a pure function of
    (seed, epoch, b), whatever the number of ranks, and rank ``r`` of ``W`` takes ``batch[r::W]``. So a run
    stopped after global batch ``b`` and resumed on any number of ranks that divides the global batch
    trains every sample of the epoch exactly once, starting at ``b + 1`` without reading the batches before.

    With one rank, or when the dataset divides among the ranks, the slices are exactly the batches the
    rank-strided :class:`ResumableBatchSampler` yields (its rank ``r`` takes ``perm[r::W]`` in batches of
    ``global_batch / W``). Its one difference, padding an uneven dataset by wrapping around, is kept by
    ``wrap_pad=True`` so that checkpoints of that scheme still resume bit for bit on their own rank count.

    ``configure`` changes the number of ranks in place: the DataLoader keeps its batch sampler for life.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, wrap_pad: bool = False) -> None:
        _check_int("num_samples", num_samples, minimum=1)
        _check_int("seed", seed)
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.start_batch = 0
        self.configure(global_batch, num_replicas, rank, wrap_pad)

    def configure(self, global_batch: int, num_replicas: int, rank: int, wrap_pad: bool = False) -> None:
        """Take ``global_batch / num_replicas`` samples of each global batch, as rank ``rank``."""
        _check_int("global_batch", global_batch, minimum=1)
        _check_int("num_replicas", num_replicas, minimum=1)
        _check_int("rank", rank, minimum=0)
        if rank >= num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
        if global_batch % num_replicas:
            raise ValueError(f"a global batch of {global_batch} does not divide among {num_replicas} ranks")
        self.global_batch, self.num_replicas, self.rank, self.wrap_pad = global_batch, num_replicas, rank, wrap_pad
        if len(self) < 1:
            raise ValueError(f"a global batch of {global_batch} leaves no batch in {self.num_samples} samples")

    @property
    def batch_size(self) -> int:
        """Samples per rank and step."""
        return self.global_batch // self.num_replicas

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch to iterate and the global batch to start at (the timer's ``batch_in_epoch``)."""
        _check_int("epoch", epoch, minimum=0)
        _check_int("start_batch", start_batch, minimum=0)
        if start_batch > len(self):
            raise ValueError(f"start_batch must be in [0, {len(self)}] (batches per epoch), got {start_batch}")
        self.epoch, self.start_batch = epoch, start_batch

    def _order(self) -> torch.Tensor:
        order = epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle)
        if self.wrap_pad:
            return wrapped(order, -(-self.num_samples // self.num_replicas) * self.num_replicas)
        return order

    def __iter__(self) -> Iterator[list[int]]:
        order, size = self._order(), self.global_batch
        for batch in range(self.start_batch, len(self)):
            yield order[batch * size : (batch + 1) * size][self.rank :: self.num_replicas].tolist()

    def __len__(self) -> int:
        if self.wrap_pad:  # the rank-strided scheme: ceil(N / W) samples per rank, whole batches of them
            return -(-self.num_samples // self.num_replicas) // self.batch_size
        return self.num_samples // self.global_batch

    def __repr__(self) -> str:
        return (f"GlobalBatchSampler(num_samples={self.num_samples}, global_batch={self.global_batch}, "
                f"seed={self.seed}, num_replicas={self.num_replicas}, rank={self.rank}, shuffle={self.shuffle}, "
                f"wrap_pad={self.wrap_pad}, epoch={self.epoch}, start_batch={self.start_batch})")
