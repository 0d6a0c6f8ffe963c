"""The training loop. It reads in one screen; checkpointing, evaluation cadence and stopping are
delegated to the objects handed in."""
from __future__ import annotations

import contextlib
import logging
import time
from itertools import islice
from typing import Any, Callable

import torch

from job import ddp_buckets, distributed
from job.batches import batch_size, split, to_device
from job.build import Run
from job.logs import event
from job.schedule import Interval
from state import State

logger = logging.getLogger(__name__)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP wrapper: forward goes through DDP (gradient sync), the rest does not."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _metric_args(model: torch.nn.Module, outputs: torch.Tensor, batch: Any) -> tuple[Any, ...]:
    custom = getattr(model, "metric_args", None)
    return tuple(custom(outputs, batch)) if custom else (outputs, batch[1])


class Trainer:
    """Runs optimizer steps until max_duration, or until ``should_stop(state)`` says so after a step.

    ``before_update`` runs right before each optimizer step: a checkpoint still copying the parameters
    and optimizer state in the background is finished there (Checkpointer.before_update)."""

    def __init__(self, run: Run, eval_interval: Interval, log_interval: int,
                 after_step: Callable[[State, bool], None],
                 should_stop: Callable[[State], bool] = lambda state: False,
                 before_update: Callable[[], None] = lambda: None) -> None:
        self.run, self.state = run, run.state
        self.eval_interval, self.log_interval = eval_interval, log_interval
        self.after_step, self.should_stop, self.before_update = after_step, should_stop, before_update
        self._last_eval = time.monotonic()
        self._settled = False

    def done(self) -> bool:
        return self.state.timer.get(self.state.max_duration.unit) >= self.state.max_duration

    def fit(self) -> None:
        state = self.state
        window_start, window_samples = time.perf_counter(), 0
        while not self.done() and not self.should_stop(state):
            epoch, start = state.data_position
            self.run.sampler.set_epoch(epoch, start)
            stepped = 0
            for batch in islice(state.train_dataloader, state.steps_per_epoch - start):
                lr = state.optimizers[0].param_groups[0]["lr"]  # this step's (the schedulers move it after)
                loss = self.train_step(to_device(batch, self.run.device))
                stepped += 1
                window_samples += batch_size(batch)
                epoch_ended = state.timer.batch_in_epoch.value >= state.steps_per_epoch
                if epoch_ended:
                    self.end_epoch()
                if state.timer.batch.value % self.log_interval == 0:
                    elapsed = time.perf_counter() - window_start
                    event(logger, "progress", step=state.timer.batch.value, epoch=state.timer.epoch.value,
                          loss=round(loss.item(), 6), samples_per_sec=round(window_samples / max(elapsed, 1e-9), 1),
                          lr=float(f"{float(lr):.6g}"))
                    window_start, window_samples = time.perf_counter(), 0
                if self.eval_interval.due(state.timer, epoch_ended, time.monotonic() - self._last_eval) or self.done():
                    self.evaluate()
                self.after_step(state, epoch_ended)
                if epoch_ended or self.done() or self.should_stop(state):
                    break
            if stepped == 0:
                raise RuntimeError("the training data loader yielded no batches")

    def train_step(self, batch: Any) -> torch.Tensor:
        state, model = self.state, self.state.model
        core = unwrap(model)
        model.train()
        optimizer = state.optimizers[0]
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.run.device)
        samples = batch_size(batch)  # a batch the job cannot count or cut: ConfigError at the first one
        micros = split(batch, state.grad_accum)
        if not self._settled:  # every step of every life all-reduces in DDP's regrouped buckets (job.ddp_buckets)
            ddp_buckets.settle(model, state, micros[0], self.run.world_size)
            self._settled = True
        for i, micro in enumerate(micros):
            state.batch = micro
            # Under DDP, gradients are all-reduced once per step, on the last micro-batch.
            sync = contextlib.nullcontext() if model is core or i == len(micros) - 1 else model.no_sync()
            with sync:
                with state.precision_context:
                    outputs = model(micro)
                    loss = core.loss(outputs, micro) / state.grad_accum
                (state.scaler.scale(loss) if state.scaler else loss).backward()
            total += loss.detach()
            with torch.no_grad():
                for metric in state.train_metrics.values():
                    metric.update(*_metric_args(core, outputs.detach(), micro))
        self.before_update()
        if state.scaler:
            state.scaler.step(optimizer)
            state.scaler.update()
        else:
            optimizer.step()
        for scheduler in state.schedulers:
            scheduler.step()
        # Counted for the whole job. Every rank trains an equal number of samples of each step, but not of
        # tokens: those are summed, so that every rank's timer, and a --max-duration in tokens, agree.
        tokens = distributed.total(int(core.num_tokens(batch))) if hasattr(core, "num_tokens") else 0
        state.timer.on_batch_complete(samples=samples * self.run.world_size, tokens=tokens)
        return total

    def end_epoch(self) -> None:
        state = self.state
        state.timer.on_epoch_complete()
        if state.train_metrics:
            state.current_metrics["train"] = {k: m.compute() for k, m in state.train_metrics.items()}
            for metric in state.train_metrics.values():
                metric.reset()

    @torch.no_grad()
    def evaluate(self) -> None:
        state, model = self.state, self.state.model
        core = unwrap(model)
        model.eval()
        for evaluator in state.evaluators:
            for metric in evaluator.metrics.values():
                metric.reset()
            for batch in evaluator.dataloader:
                batch = to_device(batch, self.run.device)
                with state.precision_context:
                    outputs = core(batch)  # no gradient sync to do: skip the DDP wrapper
                for metric in evaluator.metrics.values():
                    metric.update(*_metric_args(core, outputs, batch))
            state.current_metrics[evaluator.label] = {k: m.compute() for k, m in evaluator.metrics.items()}
        model.train()
        self._last_eval = time.monotonic()
        if state.evaluators:
            event(logger, "eval", step=state.timer.batch.value, epoch=state.timer.epoch.value,
                  metrics={label: {k: round(float(v), 6) for k, v in metrics.items()}
                           for label, metrics in state.current_metrics.items() if label != "train"})
