"""Resuming on whatever capacity comes back: the global batch, and the state that was per rank.

The unit of progress is the *global* batch: ``--batch-size`` x ranks at the run's first start, recorded
in every manifest with the per-device micro-batch (``batch_size / grad_accum``) and the sampler scheme.
A resume on W ranks keeps it: each rank takes ``global_batch / W`` samples of each global batch
(state.GlobalBatchSampler), in micro-batches no larger than the original one (gradient accumulation
absorbs the rest), so a smaller cluster never runs out of memory and a larger one never changes the
optimization. The learning-rate schedule and step counting are in global batches already.

What was per rank comes back like this on another number of ranks: the train-metric accumulators of
all old ranks are merged into new rank 0 (the other ranks start empty), so the epoch's train metrics are
those of an uninterrupted run (see merge_metrics for the few that cannot be merged); old rank r < W keeps its own RNG
streams, and a rank that did not exist gets streams seeded from ``derived_seed(seed, rank, step)``.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace
from typing import Any

from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat, dim_zero_max, dim_zero_min, dim_zero_sum

from job import distributed
from job.build import Run, batch_too_large, total_batches
from job.config import TrainConfig
from job.exceptions import ADVICE, CheckpointLoadError, ConfigError
from state import SEED_LIMIT
from state.display import brief
from state.metrics import load_metric_state
from state.rng import capture_rng, restore_rng, seed_all
from state.sampler import _splitmix64

logger = logging.getLogger(__name__)

# The reductions by which torchmetrics' state merge (Metric._reduce_states) turns two accumulated states into
# the one an uninterrupted run holds. Not "mean": it weighs them by update counts as forward() does one step
# into the state, which is no merge of two ranks' states (review 38: the other rank's ignored after one update).
REDUCIBLE = (dim_zero_sum, dim_zero_max, dim_zero_min, dim_zero_cat)

SAMPLER_SCHEME = "global-batch-v1"  # manifests without it were written by the rank-strided sampler
LEGACY_SCHEME = "rank-strided-v0"
MAX_RANKS = 1 << 20  # more than any cluster: a manifest that says more is damaged


@dataclass(frozen=True)
class BatchPlan:
    """How one global batch is split: among ranks, then into micro-batches on each rank."""

    global_batch: int
    micro_batch: int  # the largest micro-batch a device runs (the run's first start's)
    world: int
    scheme: str = SAMPLER_SCHEME
    written_on: int | None = None  # the ranks that wrote the checkpoint resumed (its manifest); None: a new run
    source: str = ""  # where the checkpoint resumed came from, for the errors that name it

    @property
    def checkpoint(self) -> str:
        return f"checkpoint {self.source}" if self.source else "the checkpoint"

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world

    @property
    def grad_accum(self) -> int:
        """The fewest equal micro-batches, none larger than ``micro_batch``, that make up ``per_rank``."""
        parts = -(-self.per_rank // self.micro_batch)
        while self.per_rank % parts:
            parts += 1
        return parts

    def meta(self) -> dict[str, Any]:
        return {"global_batch": self.global_batch, "micro_batch": self.micro_batch, "sampler": self.scheme}


def fresh_plan(cfg: TrainConfig, world: int) -> BatchPlan:
    """A run's first start: the flags define the global batch."""
    return BatchPlan(cfg.batch_size * world, cfg.batch_size // cfg.grad_accum, world)


def new_run_plan(cfg: TrainConfig, run: Run) -> BatchPlan:
    """The plan of a run that resumed no checkpoint: ConfigError (exit 2) when the flags' global batch is larger
    than the training set. Refused here, not when the run is built: a resume keeps its checkpoint's global batch,
    which ``--batch-size`` x ranks may exceed on a larger cluster (the flags are then ignored, with a warning)."""
    refusal = batch_too_large(cfg, run.sampler.num_samples, run.world_size)
    if refusal is not None:
        raise refusal
    return fresh_plan(cfg, run.world_size)


def resumed_plan(meta: dict[str, Any], cfg: TrainConfig, world: int, source: str = "") -> BatchPlan:
    """The global batch of the checkpoint (from ``source``) on ``world`` ranks; ConfigError (exit 2) when it
    does not divide.

    Checkpoints written before the global batch was recorded derive it from their per-rank settings.
    """
    flags = replace(fresh_plan(cfg, world), source=source)
    old_world = _ranks_that_wrote(meta, flags.checkpoint)
    global_batch, micro = (_samples(meta, key, flags.checkpoint) for key in ("global_batch", "micro_batch"))
    try:  # older checkpoints recorded their per-rank settings instead
        global_batch = global_batch or int(meta["batch_size"]) * old_world
        micro = micro or int(meta["batch_size"]) // int(meta["grad_accum"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError):
        return replace(flags, written_on=old_world)  # a checkpoint without these settings: the flags decide
    if global_batch < 1 or micro < 1:
        return replace(flags, written_on=old_world)
    if micro > global_batch:  # a device's micro-batch is part of one rank's share: 2**70 ran the share at once
        raise CheckpointLoadError(f"{flags.checkpoint} is damaged: its manifest records micro_batch {micro}, more "
                                  f"than its global_batch of {global_batch} samples; {ADVICE}")
    if global_batch % world:
        works = [n for n in range(1, min(global_batch, 1024) + 1) if global_batch % n == 0]
        raise ConfigError(
            f"the run's global batch of {global_batch} samples does not divide among {world} ranks; resume it on "
            f"{', '.join(map(str, works))} ranks (or start a new run with a --batch-size that divides)")
    plan = BatchPlan(global_batch, micro, world, str(meta.get("sampler", LEGACY_SCHEME)), old_world, source)
    if plan.global_batch != flags.global_batch:
        logger.warning("keeping the checkpoint's global batch of %d samples (%d per rank on %d ranks); --batch-size "
                       "%d x %d ranks would be %d", plan.global_batch, plan.per_rank, world, cfg.batch_size, world,
                       flags.global_batch)
    return plan


def _samples(meta: dict[str, Any], key: str, checkpoint: str) -> int | None:
    """A number of samples the manifest records (None when it does not): a whole number, at least 1."""
    value = meta.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise CheckpointLoadError(f"{checkpoint} is damaged: its manifest records {key} {brief(value, 40)}, "
                                  f"not a number of samples; {ADVICE}")
    return value


def _ranks_that_wrote(meta: dict[str, Any], checkpoint: str) -> int:
    """The number of ranks that wrote a checkpoint, from its manifest (1 when not recorded)."""
    value = meta.get("world_size", 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        raise CheckpointLoadError(f"{checkpoint} is damaged: its manifest records world_size {brief(value, 40)}, "
                                  f"not a number of ranks; {ADVICE}")
    return value


def apply_plan(plan: BatchPlan, run: Run, cfg: TrainConfig) -> None:
    """Split each global batch as ``plan`` says: the sampler's slices, the micro-batches, the schedule's
    length. The rank-strided scheme's padding is kept only on its own rank count (bit-exact there).

    The checkpoint's position must lie inside an epoch of this data: further on (other --data, or a
    damaged timer) the loop would fail at its first batch."""
    old_world = plan.written_on or plan.world
    try:
        run.sampler.configure(plan.global_batch, plan.world, distributed.rank(),
                              wrap_pad=plan.scheme == LEGACY_SCHEME and old_world == plan.world)
    except ValueError as e:
        raise CheckpointLoadError(f"{plan.checkpoint} was written for other --data, or is damaged: its global batch "
                                  f"does not fit this data ({e}); resume it with its own --data, or {ADVICE}") from None
    position = run.state.timer.batch_in_epoch.value
    if position >= len(run.sampler):
        if plan.scheme == LEGACY_SCHEME and old_world != plan.world:
            raise ConfigError(  # its padding made epochs one global batch longer on some rank counts
                f"{plan.checkpoint} is at batch {position} of its epoch, written by the rank-strided sampler of older "
                f"releases on {old_world} ranks; on {plan.world} ranks its epoch has {len(run.sampler)} global "
                f"batches: resume it on {old_world} ranks until the next epoch begins")
        raise CheckpointLoadError(
            f"{plan.checkpoint} is at batch {position} of its epoch, but an epoch of this data has {len(run.sampler)} "
            f"global batches: it was written for other --data, or is damaged; resume it with its own --data, "
            f"or {ADVICE}")
    run.state.grad_accum = plan.grad_accum
    run.schedule_steps = total_batches(cfg, len(run.sampler), plan.global_batch)


def derived_seed(seed: int, rank: int, step: int) -> int:
    """The seed of a rank that did not exist when the checkpoint was written (documented in the README)."""
    return _splitmix64(_splitmix64(_splitmix64(seed) ^ rank) ^ step) % SEED_LIMIT


def derived_rng(seed: int, rank: int, step: int) -> dict[str, Any]:
    """RNG streams (python, numpy, torch) of a new rank, without disturbing the current ones."""
    current = capture_rng()
    try:
        seed_all(derived_seed(seed, rank, step))
        return capture_rng()
    finally:
        restore_rng(current)


@dataclass
class Handover:
    """What one rank loads from a checkpoint, and what it does to its train metrics afterwards."""

    tree: dict[str, Any]
    merge: list[dict[str, Any]]  # other old ranks' metric snapshots to merge in (new rank 0)
    reset_metrics: bool = False  # start the epoch's accumulators empty (new ranks > 0)

    def finish(self, metrics: dict[str, Any]) -> None:
        """After State.load_state_dict(tree): merge or reset the train-metric accumulators."""
        if self.reset_metrics:
            for metric in metrics.values():
                metric.reset()
        merge_metrics(metrics, self.merge)


def for_this_rank(tree: dict[str, Any], rank: int, world: int, seed: int, step: int, source: str) -> Handover:
    """How this rank loads a full checkpoint written by one or more ranks (module docstring)."""
    mine = dict(tree)
    per_rank = mine.pop(distributed.PER_RANK, None)
    if per_rank is None:
        per_rank = [{k: tree.get(k) for k in distributed.PER_RANK_KEYS}]
    if not isinstance(per_rank, list) or not per_rank or not all(map(_rank_state, per_rank)):
        raise CheckpointLoadError(f"checkpoint {source} is damaged: its per-rank states are not a list of "
                                  f"mappings of {', '.join(distributed.PER_RANK_KEYS)}; {ADVICE}")
    if len(per_rank) == world:  # the same ranks: each its own, exactly
        mine.update({k: v for k, v in per_rank[rank].items() if v is not None})
        return Handover(mine, [])
    if rank < len(per_rank):  # an old rank's streams go on; one without them is damage, not a new rank
        if not per_rank[rank].get("rng"):
            raise CheckpointLoadError(f"checkpoint {source} is damaged: the state of its rank {rank} has no rng "
                                      f"(every rank saves its own); {ADVICE}")
        mine["rng"] = per_rank[rank]["rng"]
    else:
        mine["rng"] = derived_rng(seed, rank, step)
    if per_rank[0].get("train_metrics") is not None:
        mine["train_metrics"] = per_rank[0]["train_metrics"]  # new rank 0: old rank 0's, then the others'
    if rank > 0:
        return Handover(mine, [], reset_metrics=True)
    return Handover(mine, [p["train_metrics"] for p in per_rank[1:] if p.get("train_metrics")])


def _rank_state(found: Any) -> bool:
    """One rank's entry as a checkpoint holds it: a mapping whose rng and train_metrics are mappings or
    absent (the truth tests below, and the metric merge, failed on anything else with a traceback)."""
    return isinstance(found, dict) and all(isinstance(found.get(k), (dict, type(None)))
                                           for k in distributed.PER_RANK_KEYS)


def merge_metrics(metrics: dict[str, Any], snapshots: list[dict[str, Any]]) -> None:
    """Add other ranks' accumulator snapshots (state.metrics.metric_state) into ``metrics``.

    Each state is combined with its own ``dist_reduce_fx``, as torchmetrics combines the ranks' states at
    the epoch's end, and as its ``merge_state`` does; a metric's own ``merge_state`` override is used as it
    is. torchmetrics' default ``merge_state`` refuses every metric with ``full_state_update`` True or unset
    (custom metrics by default, MaxMetric, ...), although that flag is about its ``forward``, not about how
    states combine; refusing them made a good checkpoint "damaged" on another number of ranks. Tensor states
    without a reduction (Pearson's running moments) or averaged ones ("mean") cannot be combined and then
    updated on: such a metric keeps new rank 0's accumulation only, with a warning; it is what is reported,
    never what is trained.
    """
    unmerged: set[str] = set()
    for snapshot in snapshots:
        for name, metric in metrics.items():
            if name not in snapshot:
                continue
            other = copy.deepcopy(metric)
            other.reset()
            load_metric_state(other, snapshot[name])
            if other._update_count == 0:
                continue  # nothing accumulated there (an epoch's start)
            count = metric._update_count + other._update_count
            if _merges_itself(metric):
                metric.merge_state(other)
            elif _reducible(metric):
                metric._reduce_states(other.metric_state)  # merge_state's own merge, past its refusal
            else:
                unmerged.add(name)
                continue
            metric._update_count = count  # merging leaves it: compute() must not think it never ran
    if unmerged:
        logger.warning("train metric(s) %s cannot be merged across the old ranks (a state whose reduction cannot "
                       "combine two: none, or a mean): this epoch's value covers only what the new rank 0 holds; "
                       "training is unchanged", ", ".join(sorted(unmerged)))


def _merges_itself(metric: Metric) -> bool:
    """Its class overrides ``merge_state``, so it knows how to combine its own states. torchmetrics' default
    allows ``full_state_update=False`` metrics whatever their reductions, averaging a "mean" state as one more
    step and stacking a state without one: those go through ``_reducible`` like any other."""
    return type(metric).merge_state is not Metric.merge_state


def _reducible(metric: Metric) -> bool:
    """Every state has a reduction that combines two states into one of the same kind: one of REDUCIBLE (not
    mean: see there), or none for a list state, which torchmetrics' merge joins as it joins "cat" lists
    (retrieval metrics, SSIM). None on a tensor state (Pearson's running moments) stacks the two."""
    return not metric.dist_sync_on_step and all(
        fn in REDUCIBLE or (fn is None and isinstance(metric._defaults[name], list))
        for name, fn in metric._reductions.items())
