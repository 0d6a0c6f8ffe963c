"""One training job from start to finish: build, resume, train, checkpoint on cadence, finish or stop.

The CLI hands in validated configs; this module wires the components (checkpointer, remote store,
stop request, spot notices) and owns only the order of events.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from job.build import build, refit_schedule
from job import distributed, elastic, leavable
from job.cadence import CheckpointCadence
from job.checkpoint import Checkpointer, check_nodes_can_resume, claim_folder
from job.curves import recording
from job.config import CheckpointConfig, TrainConfig
from job.exceptions import EXIT_PREEMPTED, ConfigError, exit_code_for
from job.ledger import Ledger
from job.logs import event
from job.loop import Trainer, unwrap
from job.resume import announce, check_new_run, expects_checkpoint, resume
from job.resumed_check import ResumedCheck
from job.schedule import resolve_at_start
from job.signals import StopRequest
from job.spot import SpotHandler, SpotWatcher
from job.storage import RemoteConfig, RemoteStore
from state import State, TimeUnit
from uploader import local
from uploader.worker import ABORT_GRACE

logger = logging.getLogger(__name__)

# Margin kept between the end of our own work and the deadline (the kill): process exit, log flush.
EXIT_MARGIN_SECONDS = 1.0


def run_meta(cfg: TrainConfig) -> dict[str, Any]:
    """Recorded in every manifest: what a resume must match to be exact, and what wrote it."""
    return {
        "model": cfg.model,
        "data": cfg.data,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "grad_accum": cfg.grad_accum,
        "world_size": distributed.world_size(),
        "sharded": cfg.sharded,
        "torch": torch.__version__,
    }


@dataclass
class Outcome:
    state: State
    preempted: bool
    # A checkpoint write still running at the end (a grace period too short to wait for it): the
    # process must exit without the interpreter's shutdown, which aborts a thread inside torch.save.
    writing: bool = False


def _until_exit(stop: StopRequest, then: float = 0.0) -> float | None:
    """Seconds our waits may take before the kill, ``then`` seconds of later work left over; None (no
    limit) without a deadline, since the thread and lock waits below refuse an infinite timeout."""
    left = stop.time_left() - EXIT_MARGIN_SECONDS - then
    return None if math.isinf(left) else max(left, 0.0)


def _failure_of(work: Callable[[], object]) -> Exception | None:
    """What ``work`` raised, for the per-step agree to tell every rank of (then distributed.raise_together)."""
    try:
        work()
    except Exception as e:  # noqa: BLE001 - raised by the caller, once every rank has heard of it
        return e
    return None


def _stop_everywhere(stop: StopRequest) -> None:
    """Collective, where the ranks agreed to stop: a rank that saw no signal itself requests the stop,
    naming the reason another rank has, so that its ledger and events say why it stopped."""
    why = next((r for r in distributed.all_gather(stop.reason) if r is not None), "another rank")
    if not stop.requested:
        stop.request(f"{why} (on another rank)")
        event(logger, "stop_requested", reason=stop.reason, grace_seconds=stop.grace_period)


def _stop_for_preemption(state: State, cadence: CheckpointCadence, store: RemoteStore | None,
                         stop: StopRequest) -> None:
    """Within the grace period: a final checkpoint, its upload, and a clear account of what was kept."""
    step = state.timer.batch.value
    needed = cadence.estimate_seconds(state) * 1.5 + EXIT_MARGIN_SECONDS
    # The save is a collective: rank 0's estimate of it against the time of the rank that has the least left.
    left = min(distributed.all_gather(stop.time_left()))
    if distributed.broadcast_choice(not cadence.saved_now(state) and left < needed):
        cadence.checkpointer.wait(_until_exit(stop))
        durable = False
    elif cadence.saved_now(state):  # this step's checkpoint is taken already: it has only to finish, in time
        durable = cadence.checkpointer.wait(_until_exit(stop))
    else:
        cadence.save_durable(state)
        durable = True
    # From here on nothing is pruned, so the checkpoint the event names is on disk for the next start.
    cadence.checkpointer.freeze_retention()
    writing = cadence.writing_step()  # before kept: a write that commits in between is named by one of the two
    kept = cadence.kept_step()
    committed_here = cadence.checkpointer.last_committed is not None  # not a node whose folder stays empty (DDP)
    if committed_here and kept is not None and not cadence.checkpointer.committed(kept):
        # The write in flight committed, and pruned the one before it, just before the freeze.
        kept = cadence.last_step
    if not durable:
        event(logger, "grace_too_short", level=logging.WARNING, step=step, seconds_left=round(stop.time_left(), 1),
              seconds_needed=round(needed, 1), kept_step=kept,
              message="no time for a final checkpoint; exiting before the kill with the previous one")
    upload = None
    if store is not None and store.uploads and kept is not None:
        cadence.checkpointer.announce(kept)
        # Then the store's close aborts an upload still running, and gives it ABORT_GRACE to stop.
        upload = functools.partial(store.wait, _until_exit(stop, then=ABORT_GRACE))
    # Null in the event where this job does not upload (no remote, sidecar, off). Also the barrier before FINISHED.
    uploaded = distributed.run_together(upload, "upload its checkpoints")
    if uploaded is False:
        logger.warning("the final checkpoint did not finish uploading within the grace period; it stays in "
                       "%s for a sidecar or the next start", cadence.checkpointer.folder)
    if kept is not None and distributed.node_leader():  # every node's sidecar may leave
        local.mark_finished(cadence.checkpointer.folder, kept, reason="preempted")
    event(logger, "preempted", step=step, checkpoint_step=kept, writing_step=writing if writing != kept else None,
          uploaded=uploaded, reason=stop.reason)


def _stopped_before_training(folder: Path, stop: StopRequest, why: Exception) -> None:
    """A stop request while the start-up waited for a download: no step was trained, so nothing is saved;
    the checkpoints already on disk and in the bucket are the ones the next start finds."""
    if distributed.node_leader():  # sidecars may leave
        committed = local.list_committed(folder)
        local.mark_finished(folder, committed[-1].step if committed else 0, reason="preempted")
    event(logger, "preempted", step=None, checkpoint_step=None, uploaded=None, reason=stop.reason or str(why))


def _mark_failed(folder: Path) -> None:
    """Let a sidecar finish uploading and exit instead of waiting for a job that is gone."""
    committed = local.list_committed(folder)
    try:
        local.mark_finished(folder, committed[-1].step if committed else 0, reason="failed")
    except OSError:
        logger.debug("could not mark %s failed", folder, exc_info=True)


def train(cfg: TrainConfig, ckpt_cfg: CheckpointConfig, remote_cfg: RemoteConfig | None = None,
          stop: StopRequest | None = None, spot: SpotWatcher | None = None) -> Outcome:
    """Train to max_duration, or until ``stop`` is requested; always ending on a committed checkpoint."""
    stop = stop or StopRequest(grace_period=float("inf"))
    leader = distributed.rank() == 0
    # Sharded on several nodes: each node writes its part to its own disk and uploads it itself.
    node_uploads = cfg.sharded and distributed.nodes() > 1 and distributed.node_leader()
    if leader or node_uploads:
        claim_folder(ckpt_cfg.folder)
    if cfg.sharded:
        remote = remote_cfg is not None and bool(remote_cfg.url)
        check_nodes_can_resume(ckpt_cfg.folder, remote, remote and remote_cfg is not None and remote_cfg.mode != "off")
    # A download gives up on a stop here, or where another rank left a wait for the others (job.leavable).
    store = (RemoteStore(remote_cfg, ckpt_cfg.folder, stopped=lambda: stop.reason or leavable.left())
             if (leader or node_uploads) and remote_cfg is not None and remote_cfg.url else None)
    # The newest remote checkpoint downloads while the model is built: a resume waits for the larger one.
    # Sharded on several nodes, each node downloads later, once the model says what its ranks read (job.node_pull).
    pulling = (store.start_pull(ckpt_cfg.folder) if store is not None and ckpt_cfg.resume == "auto"
               and not node_uploads else None)
    life = Ledger.open(ckpt_cfg.folder, distributed.world_size(), store.remote if store is not None else None,
                       store.sync_runlog if store is not None else None) if leader else None
    curves = contextlib.ExitStack()  # the TensorBoard writer, from the first step to the end (job.curves)
    checkpointer: Checkpointer | None = None
    check: ResumedCheck | None = None  # the resumed state's NaN check, during the first step (job.resumed_check)
    failed = False
    try:
        if ckpt_cfg.resume == "never":
            distributed.decided_by_first(lambda: check_new_run(ckpt_cfg, store), "start a new run")
        if store is not None:  # while the pull runs: read-only credentials fail before the model is built
            store.check_writable()
        # Uninitialised where a checkpoint will overwrite the weights, and always when sharded: then no device
        # ever holds the whole model, a first start's included (Run.initialise gives each rank its slices).
        run = build(cfg, defer_init=cfg.sharded or expects_checkpoint(ckpt_cfg, store))
        event(logger, "built", model=cfg.model, deferred_init=run.pending_init is not None)
        state = run.state
        if cfg.max_duration.unit == TimeUnit.TOKEN and not hasattr(unwrap(state.model), "num_tokens"):
            raise ConfigError(f"--max-duration {cfg.max_duration} counts tokens, but --model {cfg.model!r} "
                              "has no num_tokens(batch)")
        meta = run_meta(cfg)
        checkpointer = Checkpointer(ckpt_cfg.folder, ckpt_cfg.keep, meta,
                                    protect=store.pending if store is not None else None,
                                    on_commit=store.submit if store is not None else None,
                                    pin_memory=cfg.device == "cuda", sharded=cfg.sharded)
        leavable.leave_on(lambda: stop.reason)  # until the first step, a stopped rank leaves waits for the others
        resumed = resume(state, ckpt_cfg, checkpointer, meta, store, run.mesh, pulling)
        if resumed is None:
            plan = elastic.new_run_plan(cfg, run)
            run.initialise()
        else:
            plan = elastic.resumed_plan(resumed.meta, cfg, run.world_size, resumed.source)
            elastic.apply_plan(plan, run, cfg)
            refit_schedule(run, cfg.lr)
            announce(state, resumed)
            check = ResumedCheck(state, resumed.source)
        checkpointer.meta = {**meta, **plan.meta()}
        eval_interval = resolve_at_start("--eval-interval", cfg.eval_interval, state, plan.global_batch)
        save_interval = resolve_at_start("--save-interval", ckpt_cfg.interval, state, plan.global_batch)
        cadence = CheckpointCadence(checkpointer, replace(ckpt_cfg, interval=save_interval))
        if resumed is not None and resumed.own:  # a --resume PATH elsewhere is not saved here yet (Resumed.own)
            cadence.last_step = state.timer.batch.value
        if ckpt_cfg.async_save:
            checkpointer.reserve(state)
        leavable.leave_on(None)  # from here a stop is answered with a checkpoint (the per-step agree)
        spot_handler = SpotHandler(spot, stop) if spot is not None else None
        stopping = False

        def after_step(state: State, epoch_ended: bool) -> None:
            nonlocal stopping
            checkpoint_now = cadence.due(state, epoch_ended)
            if spot_handler is not None:
                checkpoint_now = spot_handler.poll(state) or checkpoint_now
            failure = _failure_of(store.check) if store is not None else None
            stale = checkpointer.take_discarded() is not None
            # One collective per step under torchrun: any rank's signal, due checkpoint, failed upload, stale
            # snapshot or failed background write counts for all (the uploading or writing rank's failure reaches
            # the others with its exit code, not as a hang; rank 0's discarded snapshot is retaken by every rank's
            # cadence alike).
            checkpoint_now, stopping, failed, stale, write_failed = distributed.agree(
                checkpoint_now, stop.should_stop(state), failure is not None, stale, checkpointer.write_failed())
            if write_failed:  # the checkpoint written in the background: its failure now, on every rank
                checkpointer.wait()
            if failed:
                distributed.raise_together(failure, "upload its checkpoints")
            if stale:
                cadence.retake()
                checkpoint_now = True
            if stopping:  # at this step on every rank, once: the ledger and the events learn why
                _stop_everywhere(stop)
            if checkpoint_now:
                cadence.take(state)
            else:  # a sharded checkpoint in flight completes once every rank has written its part
                checkpointer.poll()

        def should_stop(state: State) -> bool:
            return stopping if distributed.active() else stop.should_stop(state)

        def before_update() -> None:
            if check is not None:
                check.answer()
            checkpointer.before_update()

        if leader and cfg.tensorboard:
            curves.enter_context(recording(ckpt_cfg.folder, start_step=state.timer.batch.value))
        event(logger, "start", step=state.timer.batch.value, max_duration=str(state.max_duration),
              device=cfg.device, precision=cfg.precision.value, world_size=distributed.world_size(),
              parameters=sum(p.numel() for p in state.model.parameters()))
        Trainer(run, eval_interval, cfg.log_interval, after_step=after_step, should_stop=should_stop,
                before_update=before_update).fit()
        if check is not None:  # no step ran (at max_duration already, a stop before the first): before any save
            check.answer()
        if distributed.active() and not stopping and distributed.agree(stop.requested)[0]:
            # A signal after the last step's agree (the final save is in it) reaches one node's processes only:
            # every rank decides on this agreed value, never on its own flag, or they part ways in collectives.
            _stop_everywhere(stop)
            stopping = True
        if stopping if distributed.active() else stop.requested:
            _stop_for_preemption(state, cadence, store, stop)
            return Outcome(state, preempted=True, writing=checkpointer.busy())
        cadence.save_durable(state)
        final_upload = None
        if store is not None:
            checkpointer.announce(state.timer.batch.value)
            final_upload = functools.partial(store.wait_final, state.timer.batch.value, ckpt_cfg.folder)
        # Also the barrier: no node marks its folder finished before every upload has ended.
        distributed.run_together(final_upload, "upload the final checkpoint")
        if distributed.node_leader():  # on other nodes the folder is empty: their sidecars simply leave
            local.mark_finished(ckpt_cfg.folder, state.timer.batch.value, reason="completed")
        event(logger, "finished", step=state.timer.batch.value, epoch=state.timer.epoch.value,
              metrics={label: {k: round(float(v), 6) for k, v in m.items()} for label, m in state.current_metrics.items()})
        return Outcome(state, preempted=False)
    except Exception as e:
        if checkpointer is not None and exit_code_for(e) == EXIT_PREEMPTED:  # on this rank or rank 0 (job.storage.Pull)
            _stopped_before_training(ckpt_cfg.folder, stop, e)
            return Outcome(state, preempted=True)
        failed = True
        leavable.fail(e)  # before training: the other ranks stop waiting for this one, with its exit code
        if life is not None:
            life.failed(e)
        if checkpointer is not None:  # a failure in the loop can find a checkpoint being written
            checkpointer.close(timeout=_until_exit(stop))
        if distributed.node_leader():
            _mark_failed(ckpt_cfg.folder)
        raise
    finally:
        leavable.leave_on(None)
        if check is not None:
            check.close()
        curves.close()
        if life is not None:
            life.close()
        if store is not None:  # a failed or stopped job does not wait for uploads: they had their time
            store.close(timeout=0 if stop.requested or failed else None)
        if life is not None:
            life.settle()
