"""Turn a TrainConfig into a ready State: model, data, optimizer, schedule, metrics, seeded.

Everything that consumes randomness at construction (model init) runs right after seeding, in the
same order on a fresh start and on a resume, so a resume only has to overwrite state.
"""
from __future__ import annotations

import gc
import logging
import math
import signal
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from job import deferred_init, distributed
from job.config import TrainConfig
from job.exceptions import ConfigError
from job.plugins import data_factory, model_factory
from state import TIMER_LIMIT, Evaluator, GlobalBatchSampler, Precision, State, TimeUnit, seed_all

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """A State plus the pieces the loop drives but the State does not own."""

    state: State
    sampler: GlobalBatchSampler  # its global batch may change on resume (job.elastic)
    device: torch.device
    world_size: int = 1
    mesh: DeviceMesh | None = None  # set when the model is sharded (FSDP2)
    schedule_steps: int | None = None  # the LR schedule's length the flags ask for (None: no schedule)
    pending_init: Callable[[], None] | None = None  # set while the model's weights are uninitialised

    def initialise(self) -> None:
        """Called when no checkpoint was loaded: a model built uninitialised gets a normal start's weights."""
        if self.pending_init is not None:
            self.pending_init()
            self.pending_init = None


def _dataset(factory: Any, split: str, spec: str) -> Dataset:
    ds = factory(split)
    try:
        n = len(ds)
    except TypeError:
        raise ConfigError(f"--data {spec!r}: split {split!r} is not a map-style Dataset (no len())") from None
    if n == 0:
        raise ConfigError(f"--data {spec!r}: split {split!r} is empty")
    return ds


def _metrics(model: torch.nn.Module, train: bool) -> dict[str, Any]:
    fn = getattr(model, "metrics", None)
    if fn is None:
        return {}
    found = fn(train)
    if found is None:
        return {}
    if isinstance(found, dict):
        return dict(found)
    if hasattr(found, "items"):  # MetricCollection
        return dict(found.items())
    return {type(found).__name__: found}


def batch_too_large(cfg: TrainConfig, samples: int, world: int) -> ConfigError | None:
    """The refusal of a --batch-size whose global batch on ``world`` ranks is larger than the training set
    (``samples``); None when it fits. It refuses a new run only (job.elastic.new_run_plan): a resume keeps
    its checkpoint's global batch and ignores the flags' (README, "Resuming on another number of GPUs")."""
    if samples < cfg.batch_size:
        return ConfigError(f"--batch-size {cfg.batch_size} is larger than the training set ({samples} samples)")
    if samples < cfg.batch_size * world:
        return ConfigError(f"--batch-size {cfg.batch_size} on {world} ranks is a global batch larger than the "
                           f"training set ({samples} samples)")
    return None


def total_batches(cfg: TrainConfig, steps_per_epoch: int, global_batch: int) -> int | None:
    """Length of the LR schedule in optimizer steps (global batches); None when it cannot be known (tokens).

    ConfigError when the run would count samples past state.TIMER_LIMIT: its checkpoints would then be
    refused as damaged at the next start (10**20ep trained, and every later start exited 6)."""
    d = cfg.max_duration
    if d.unit == TimeUnit.EPOCH:
        steps = int(d.value) * steps_per_epoch
    elif d.unit == TimeUnit.BATCH:
        steps = int(d.value)
    elif d.unit == TimeUnit.SAMPLE:
        steps = math.ceil(int(d.value) / global_batch)
    else:
        return None
    if steps * global_batch >= TIMER_LIMIT:
        raise ConfigError(f"--max-duration {d} is {steps} steps of {global_batch} samples, beyond the 2**62 "
                          "samples a run counts to; give a shorter one")
    return steps


def leave_stop_signals_to_the_job(worker_id: int) -> None:
    """DataLoader workers ignore SIGINT and SIGTERM; the job stops them when it stops.

    A forked worker inherits the job's stop handler, and Ctrl-C reaches every process of the
    terminal's group. Each worker then announced a stop of its own, and on a second Ctrl-C exited 75
    under the DataLoader. A worker whose job dies without stopping it exits by itself (PyTorch's
    parent watchdog).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def build(cfg: TrainConfig, defer_init: bool = False) -> Run:
    """``defer_init``: a checkpoint is expected to be loaded, so a model that allows it is left uninitialised
    (job.deferred_init), and ``Run.initialise`` gives it its weights if none is. A deferred ``--sharded``
    model is sharded on the meta device and only each rank's shards are allocated: no device holds it whole."""
    run = _assemble(cfg, defer_init)
    if run is None:  # the first assembly is gone (a reference cycle freed too) before the second allocates
        gc.collect()
        run = _assemble(cfg, defer_init=False)
    return run


def _assemble(cfg: TrainConfig, defer_init: bool) -> Run | None:
    """The Run; None where the model was deferred and something built after it drew from the global random
    generators (a --data set drawn with torch.randn): it would differ from a normal start's; or where the
    ranks did not all defer (``_start_over``)."""
    rank, world = distributed.rank(), distributed.world_size()

    def seed() -> None:
        seed_all(cfg.seed + rank)  # State.seed: rank_zero_seed + rank (DDP then copies rank 0's weights)

    seed()
    device = torch.device(cfg.device)
    factory, name = model_factory(cfg.model), f"--model {cfg.model!r}"
    # Every rank defers, or none: under DistributedDataParallel a first start's initialisation ends in a
    # broadcast all ranks join (a sharded one's has no collective), and only the ranks with a --remote (or
    # with checkpoints on their node's disk) expect a checkpoint.
    (defer,) = distributed.agree(defer_init)
    model, deferred = deferred_init.construct(factory, device, defer, name, sharded=cfg.sharded)
    module = model  # what DistributedDataParallel wraps below: the weights a first start gives (Run.initialise)
    rng_kept = deferred_init.rng_kept() if deferred else None
    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "loss", None)):
        raise ConfigError(f"--model {cfg.model!r} must return a torch.nn.Module with forward(batch) and loss(outputs, batch)")
    data = data_factory(cfg.data)
    train_ds, eval_ds = _dataset(data, "train", cfg.data), _dataset(data, "eval", cfg.data)
    refusal = batch_too_large(cfg, len(train_ds), world)
    if refusal is not None and len(train_ds) < world:
        raise refusal  # no global batch divides among these ranks, a checkpoint's neither
    # A resume keeps its checkpoint's global batch, whatever the flags make of it (job.elastic): where theirs is
    # larger than the data, the sampler holds the smallest one until the plan decides (a new run is refused there).
    sampler = GlobalBatchSampler(len(train_ds), world if refusal else cfg.batch_size * world, seed=cfg.seed,
                                 num_replicas=world, rank=rank)
    pin = device.type == "cuda"
    # Explicit generators: a DataLoader without one draws its worker seed from the global RNG each time
    # an iterator starts, which would make a mid-epoch resume diverge from an uninterrupted run.
    train_loader = DataLoader(train_ds, batch_sampler=sampler, num_workers=cfg.num_workers, pin_memory=pin,
                              generator=torch.Generator(), worker_init_fn=leave_stop_signals_to_the_job)
    eval_loader = DataLoader(eval_ds, batch_size=cfg.batch_size, shuffle=False, num_workers=cfg.num_workers,
                             pin_memory=pin, generator=torch.Generator(), worker_init_fn=leave_stop_signals_to_the_job)
    eval_metrics = {k: m.to(device) for k, m in _metrics(model, train=False).items()}
    train_metrics = {k: m.to(device) for k, m in _metrics(model, train=True).items()}
    if defer and _start_over(deferred, rng_kept):  # before the wrap below keeps this model until exit
        logger.info("something built after the model (--data %r, its metrics) draws from the global random "
                    "generators, or a rank could not defer: the model is built with its random initialisation, "
                    "as on a normal start", cfg.data)
        return None

    mesh = None
    if cfg.sharded:
        from job.sharded import shard_model  # DCP only where it is used (job.sharded_layout)
        mesh = shard_model(model, device, world)
        if deferred:  # sharded on the meta device: only this rank's shards are allocated
            deferred_init.allocate_shards(model, device)
        distributed.keep_until_exit(mesh)
    elif world > 1:
        model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if device.type == "cuda" else None)
        distributed.keep_until_exit(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    steps = total_batches(cfg, len(sampler), sampler.global_batch)
    schedulers = [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)] if steps else []
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == Precision.AMP_FP16 else None

    state = State(
        model=model,
        max_duration=cfg.max_duration,
        rank_zero_seed=cfg.seed,
        train_dataloader=train_loader,
        evaluators=[Evaluator(label="eval", dataloader=eval_loader, metrics=eval_metrics)] if eval_metrics else None,
        grad_accum=cfg.grad_accum,
        precision=cfg.precision,
        optimizers=optimizer,
        scaler=scaler,
        train_metrics=train_metrics,
    )
    state.schedulers = schedulers
    return Run(state=state, sampler=sampler, device=device, world_size=world, mesh=mesh, schedule_steps=steps,
               pending_init=partial(deferred_init.initialise, module, factory, seed, name) if deferred else None)


def _start_over(deferred: bool, rng_kept: Callable[[], bool] | None) -> bool:
    """Whether every rank builds again, without deferring (collective, where every rank was asked to defer).
    One rank's draws from the global generators (a --data set drawn with torch.randn) would make its data
    differ from a normal start's; and where one rank deferred and another could not (its model failed on the
    meta device), a first start's broadcast would wait for ranks that never join it."""
    drew = deferred and rng_kept is not None and not rng_kept()
    some_drew, some_deferred, some_not = distributed.agree(drew, deferred, not deferred)
    return some_drew or (some_deferred and some_not)


def refit_schedule(run: Run, lr: float) -> None:
    """After a resume, --max-duration and --lr decide the learning-rate schedule; the checkpoint only
    decides how far along it the run is.

    A checkpoint restores its scheduler whole, T_max and base learning rate included. A run extended
    from 100 to 400 batches would then follow a cosine that ended at 100 and climbs back to the peak
    by 200. When the flags ask for another schedule, the cosine is set to the new one at the current
    step, as if the run had been started with these flags. The result then differs from an
    uninterrupted run, which is logged. The same schedule is left untouched, so a resume stays bit for bit.
    """
    steps = run.schedule_steps
    if steps is None:
        return
    step = run.state.timer.batch.value  # the loop steps every scheduler once per batch
    for scheduler in run.state.schedulers:
        if not isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR):
            continue
        if scheduler.T_max == steps and all(base == lr for base in scheduler.base_lrs) and scheduler.last_epoch == step:
            continue
        # A checkpoint of a run without a schedule then (--max-duration in tokens) has none to restore: the new
        # one would start from its first step at this one.
        logger.warning("resuming with a learning-rate schedule of %d steps from lr %g, the checkpoint's was %d "
                       "steps from lr %s at its step %d: from step %d on the new one is followed, and the result "
                       "will differ from an uninterrupted run", steps, lr, scheduler.T_max,
                       "/".join(f"{b:g}" for b in scheduler.base_lrs), scheduler.last_epoch, step)
        scheduler.last_epoch = step
        scheduler.T_max = steps
        scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
        done = min(step, steps) / steps
        for group in scheduler.optimizer.param_groups:
            group["initial_lr"] = lr
            group["lr"] = scheduler.eta_min + (lr - scheduler.eta_min) * (1 + math.cos(math.pi * done)) / 2
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
