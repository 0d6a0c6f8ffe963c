"""The one owner of checkpoints: save the State atomically, find the newest good one, load it safely.

Storage format and commit protocol live in ``uploader.local`` / ``uploader.manifest`` (torch-free, shared
with the sidecar); this module adds what needs torch: serializing the State and loading it with
``torch.load(weights_only=True)``, so nothing in a checkpoint is ever executed as code. Sharded
checkpoints (``--sharded``) are written and read through job.sharded (torch.distributed.checkpoint
over job.dcp_storage); this module hashes their files and commits them like any other. It imports those
two only in the functions that handle a sharded checkpoint: a process that neither writes nor reads one
never loads DCP (job.sharded_layout).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn

import torch

from job import distributed
from job.direct_file import DirectFile
from job.exceptions import CheckpointLoadError, CheckpointWriteError, ConfigError, Diverged
from job.logs import event
from job.safe_load import first_line, load_weights_only
from job.sharded_layout import BUFFERS, MODEL, OPTIMIZERS, own_buffers, rank_file
from job.snapshot import Deferred, HostSnapshot, Path_, written_by_update
from state import State
from state.finite import collapsed_loss_scale, first_nonfinite, parameter_keys, trained_tensors
from uploader import local
from uploader.exceptions import CorruptCheckpoint, ManifestError
from uploader.hashing import BLOCK_SIZE, HashingWriter, file_digest
from uploader.manifest import RANK_FILE_RE, REPLICATED_FILE, FileEntry, Manifest

if TYPE_CHECKING:
    from torch.distributed.checkpoint.storage import WriteResult

    from job import dcp_storage
    from job.sharded import HostStaging

logger = logging.getLogger(__name__)

STATE_FILE = "state.pt"
# Settings that change the training result: resuming with other values cannot be bit-exact. The
# batch settings and the number of ranks are job.elastic's: the global batch is kept whatever they are.
RESULT_SETTINGS = ("model", "data", "seed")
WRITER_NICE = 10  # how much nicer the background writer is than the training thread


class Checkpointer:
    """Writes checkpoints of a State into one folder, keeps the newest ``keep``, reports each commit.

    ``save_async`` is the cheap path for periodic checkpoints: it blocks only for the copy into
    reused host buffers (job.snapshot) and writes in a background thread. The parameters and the
    optimizer state are copied by that thread, before it writes, while the next step runs its forward
    and backward: the loop calls :meth:`before_update` right before its optimizer step, which copies
    what that thread has not started and waits for the rest (job.snapshot's rule), then settles whether
    the forward wrote any of them meanwhile: the writer commits only after that verdict, and discards a stale
    snapshot, whose step :meth:`take_discarded` reports for a retake. At most one checkpoint is
    in flight; when the next is due before the last is durable, ``save_async`` returns False without
    doing anything, and the caller tries again after the next step: the loop never waits on the disk
    and never touches buffers that are being written. ``save`` is the durable path (end of training,
    preemption): it waits for the one in flight, then writes and commits before returning.

    Sharded (``sharded=True``, FSDP2) saves are asynchronous too, but a sharded save needs collectives
    (DCP's planning, then every rank's write results for the metadata and the manifest), and those
    must run in the training thread only: a background thread's collectives would interleave with
    training's own all-gathers in a different order on each rank (job.sharded). So a sharded save runs
    in three parts. In ``save_async`` (every rank): each rank copies its shards and its own state into
    reused host buffers (job.sharded.HostStaging, job.snapshot) and DCP plans the save, collectively.
    In a background thread per rank, with no collective: the files are written, fsynced and hashed
    from the copies. After a later step, in :meth:`poll` (or the next ``save_async``, ``save`` or
    ``wait``), once every rank's thread is done: one gather of the results, then rank 0 (or, when the
    nodes have disks of their own, each node leader for its node's part) writes the metadata and
    commits, in a thread of its own when a poll got there first. A failure anywhere is a CheckpointWriteError on every rank at that
    gather, the staging folder removed and the previous checkpoint untouched.

    No path writes a state whose parameters or optimizer state hold NaN or Inf, or whose loss scale backed off
    to 0: a run that diverged would push every good checkpoint out of retention. It is Diverged (exit 8)
    instead, found by the thread that writes (state.finite: one reading pass), on every rank where the rest of
    a failure would be.
    """

    def __init__(self, folder: Path, keep: int, meta: dict[str, Any],
                 protect: Callable[[], set[Path]] | None = None,
                 on_commit: Callable[[local.LocalCheckpoint], None] | None = None,
                 pin_memory: bool = False, sharded: bool = False) -> None:
        self.folder = folder
        self.sharded = sharded  # FSDP2: every save is sharded, with collectives in the training thread only
        self.keep = keep
        self.meta = meta
        self.protect = protect or set
        self.on_commit = on_commit
        # How long the loop was blocked by the last save (a sharded one's: its copy and plan, then the gather
        # that completes it after a later step).
        self.last_stall_seconds: float | None = None
        self.last_write_seconds: float | None = None  # check + serialize + hash + fsync + commit of the last one
        self._durable_since: float | None = None  # a durable save() is running in the training thread since
        self._snapshot = HostSnapshot(pin_memory)
        self._host_shards: HostStaging | None = None
        if sharded:
            from job.sharded import HostStaging
            self._host_shards = HostStaging(pin_memory)
        self._pending: _ShardedSave | None = None  # the sharded checkpoint in flight, on every rank alike
        self._writer: threading.Thread | None = None
        self.last_committed: int | None = None  # the step this process committed last (its writer may still run)
        self.last_taken: int | None = None  # the step of the last pipelined snapshot (save_async, rank 0)
        self._held_back: local.LocalCheckpoint | None = None  # committed here last, without on_commit
        self._deferred: Deferred | None = None  # the parameters and optimizer state the writer still copies
        self._written_outside_update: set[Path_] = set()  # tensors a forward writes: copied at once (job.snapshot)
        self._discarded: int | None = None  # the step of a snapshot found stale, never committed (take_discarded)
        self._reserving: threading.Thread | None = None
        self._error: BaseException | None = None
        self._retention = threading.Lock()  # a commit's prune, against freeze_retention
        self._retention_frozen = False

    def freeze_retention(self) -> None:
        """From now on no commit prunes (a write still in flight included): the job is stopping and is
        about to name the checkpoint it keeps, which must still exist when the next start looks."""
        with self._retention:
            self._retention_frozen = True

    def committed(self, step: int) -> bool:
        """Whether a committed checkpoint of ``step`` is in the folder now."""
        return any(c.step == step for c in local.list_committed(self.folder))

    def in_flight(self) -> bool:
        """A checkpoint is being written (sharded: taken and not yet committed)."""
        if self.sharded:
            return self._pending is not None
        return self._writer is not None and self._writer.is_alive()

    def busy(self) -> bool:
        """A thread of ours is still working in torch: writing, or reserving the snapshot buffers."""
        sharded_thread = self._pending.thread if self._pending is not None else None
        return any(t is not None and t.is_alive() for t in (self._writer, self._reserving, sharded_thread))

    def reserve(self, state: State) -> None:
        """Allocate the snapshot buffers in the background now, so the first checkpoint stalls the loop
        no longer than the ones after it. Rank 0 only: the other ranks never hold a snapshot."""
        if self.sharded or distributed.rank() != 0:
            return
        specs = self._snapshot.specs(state.state_dict())
        self._reserving = threading.Thread(target=self._snapshot.reserve, args=(specs,),
                                           name="checkpoint-reserve", daemon=True)
        self._reserving.start()

    def save_async(self, state: State) -> bool:
        """Snapshot ``state`` and write it in the background; False (nothing done) while one is in flight."""
        if self.sharded:
            return self._save_sharded_async(state)
        distributed.raise_together(self._take_background_error(), "write its checkpoint")
        (busy,) = distributed.agree(self.in_flight())
        if busy:
            return False
        started = time.perf_counter()
        tree = distributed.gather_per_rank(state.state_dict())
        if distributed.rank() != 0:  # rank 0 writes the replicated state, with every rank's own part
            return True
        self._reserved()
        parameters = parameter_keys(tree[MODEL], state.model)  # of the live tensors: a copy is not theirs
        tree, ready, self._deferred = self._snapshot.capture_pipelined(tree, self._later(state))
        step, timer = state.timer.batch.value, state.timer.state_dict()
        self.last_taken = step
        self.last_stall_seconds = time.perf_counter() - started
        self._writer = threading.Thread(target=self._write_in_background,
                                        args=(tree, ready, self._deferred, step, timer, parameters),
                                        name=f"checkpoint-{step}", daemon=True)
        self._writer.start()
        return True

    def _later(self, state: State) -> Callable[[Path_, torch.Tensor], bool]:
        """job.snapshot's rule, less the tensors found written outside the optimizer step before."""
        by_update = written_by_update(state.optimizers)
        outside = self._written_outside_update
        return lambda path, tensor: path not in outside and by_update(path, tensor)

    def before_update(self) -> None:
        """Right before the optimizer step (or anything else that writes the parameters or the optimizer
        state): finish the copy of them the checkpoint in flight has not finished, here, with training's
        threads; the time it takes counts in ``last_stall_seconds``. Then settle whether the forward wrote
        any of them meanwhile (job.snapshot). Nothing at all when no copy is running."""
        deferred = self._deferred
        if deferred is None:
            return
        if not deferred.done.is_set():
            started = time.perf_counter()
            deferred.block_writes()
            self.last_stall_seconds = (self.last_stall_seconds or 0.0) + time.perf_counter() - started
        self._settle()

    def _settle(self) -> None:
        """The training thread's verdict on the pipelined snapshot in flight (job.snapshot's Deferred.settle):
        one written since its capture is discarded by its writer, its step reported by take_discarded, and
        the tensors written are copied at once from the next checkpoint on."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        written = deferred.settle()
        if written:
            self._discarded = self.last_taken
            self._written_outside_update.update(written)
            names = ", ".join(".".join(map(str, path)) for path in written[:5]) + (" ..." if written[5:] else "")
            logger.warning("checkpoint of step %s discarded: %s changed between two optimizer steps (a module that "
                           "writes its parameters in forward, e.g. nn.Embedding(max_norm=...)); they are copied at "
                           "once from now on, and the checkpoint is taken again", self.last_taken, names)

    def write_failed(self) -> bool:
        """An unsharded write in the background has failed (a full disk: 7, a diverged state: 8), seen without
        waiting, so that the loop raises it after this step (:meth:`wait`, on every rank) instead of training on
        with no checkpoint until the next is due. A sharded one is raised at the poll after every step already."""
        return self._error is not None

    def take_discarded(self) -> int | None:
        """The step of the last snapshot discarded as stale (once): it will never be committed."""
        step, self._discarded = self._discarded, None
        return step

    def save(self, state: State) -> local.LocalCheckpoint | None:
        """Write and commit a checkpoint of ``state`` now; durable when this returns."""
        self.wait()
        started = self._durable_since = time.perf_counter()
        try:
            if self.sharded:
                ckpt = self._save_sharded_now(state)
            else:
                tree = distributed.gather_per_rank(state.state_dict())
                write = functools.partial(self._write, tree, state.timer.batch.value, state.timer.state_dict(),
                                          parameter_keys(tree[MODEL], state.model))
                ckpt = distributed.run_together(write if distributed.rank() == 0 else None, "write its checkpoint")
        finally:
            self._durable_since = None
        distributed.barrier()  # no rank goes on (or exits) before the checkpoint is durable
        self.last_stall_seconds = time.perf_counter() - started
        return ckpt

    def poll(self) -> None:
        """Collective, on every rank after every step: complete a sharded checkpoint whose files every
        rank has written (gather, then the commit in the background). Nothing at all, not even a
        collective, while no sharded checkpoint is in flight (unsharded ones complete on their own).
        A failure is a CheckpointWriteError on every rank."""
        if self._pending is not None:
            self._advance(timeout=0)

    def _save_sharded_async(self, state: State) -> bool:
        """Copy and plan now; write in the background (class docstring). False while one is in flight."""
        started = time.perf_counter()
        # The previous one, written by now but not yet gathered (no poll since), commits in this thread: the
        # new one starts at this step instead of after the commit thread, a step later.
        if not self._advance(timeout=0, background=False):
            return False
        save = self._begin_sharded(state, copy=True)
        save.thread = threading.Thread(target=self._write_shards, args=(save, True), name=f"checkpoint-{save.step}",
                                       daemon=True)
        self._pending = save
        save.thread.start()
        self.last_stall_seconds = time.perf_counter() - started
        return True

    def _save_sharded_now(self, state: State) -> local.LocalCheckpoint | None:
        """The durable sharded save: the same parts as an asynchronous one, from the live state, in this thread."""
        save = self._begin_sharded(state, copy=False)
        self._write_shards(save, background=False)
        self._pending = save
        self._advance(timeout=None, background=False)
        return save.committed

    def _begin_sharded(self, state: State, copy: bool) -> _ShardedSave:
        """Collective: the save's staging folder, this rank's files and shards (``copy``: into the host
        buffers, for a write that runs while training goes on), and DCP's plan of the shards."""
        from job import dcp_storage, sharded
        rank, world, step = distributed.rank(), distributed.world_size(), state.timer.batch.value
        save_id = distributed.broadcast_choice(uuid.uuid4().hex if rank == 0 else None)
        staging = self.folder / f"{local.STAGING_PREFIX}{local.checkpoint_name(step)}-sharded-{save_id}"
        own_disks = self._staging_per_node(staging)
        # Nodes with disks of their own upload their parts of a checkpoint each; a step is in the bucket once
        # every node has. Each node's uploader takes the newest checkpoint when it is free: nodes free at other
        # times would upload other steps, and few would ever be whole. So they upload the same ones: a save goes
        # up only when no node is still uploading; the one a run ends on always does (job.app: announce).
        upload = not own_disks or not distributed.agree(bool(self.protect()))[0]
        tree = state.state_dict()
        own = {k: tree[k] for k in distributed.PER_RANK_KEYS if k in tree}
        if world > 1:
            own[BUFFERS] = own_buffers(state.model, tree[MODEL])
        files: dict[str, Any] = {rank_file(rank, world): own}
        if rank == 0:
            files[REPLICATED_FILE] = {k: v for k, v in tree.items()
                                      if k not in (MODEL, OPTIMIZERS, *distributed.PER_RANK_KEYS)}
        shards = sharded.save_tree(state)
        parameters = parameter_keys(shards[MODEL], state.model)  # of the live shards: a copy is not theirs
        ready: list[torch.cuda.Event] = []
        failure: str | None = None
        if copy:
            try:
                files, files_ready = self._snapshot.capture(files)
                assert self._host_shards is not None
                shards, shards_ready = self._host_shards.stage(shards)
                ready = [e for e in (files_ready, shards_ready) if e is not None]
            except (RuntimeError, ValueError, TypeError) as e:  # out of host memory, or a leaf DCP cannot copy
                failure = f"rank {rank}: cannot copy the state into host memory ({first_line(e, 300)})"
        try:
            # Collective: raises on every rank if it fails on any (this rank's copy included).
            planned = dcp_storage.plan_save(shards, staging, failure)
        except CheckpointWriteError:
            if distributed.node_leader():
                shutil.rmtree(staging, ignore_errors=True)
            raise
        return _ShardedSave(step=step, save_id=save_id, staging=staging, own_disks=own_disks, upload=upload,
                            timer=dict(state.timer.state_dict()), files=files, dcp=planned, ready=ready,
                            shards=shards, parameters=parameters)

    def _write_shards(self, save: _ShardedSave, background: bool) -> None:
        """This rank's files of ``save``, fsynced and hashed. No collective: a background thread runs it.
        A failure is kept in ``save.error`` for the gather (:meth:`_advance`), never raised here."""
        if background:
            _yield_cpu_to_training()
        started, rank = time.perf_counter(), distributed.rank()
        try:
            for event in save.ready:
                event.synchronize()
            # Each rank its own shards; rank 0 the loss scale too (the replicated state's).
            self._refuse_diverged({**save.files.get(REPLICATED_FILE, {}), **save.shards}, save.parameters, save.step)
            for name, tree in save.files.items():
                save.entries.append(_write_file(save.staging / name, tree))
            with _without_torch_crc32():  # DCP torch.saves each tensor
                save.results = save.dcp.write()
            for name in save.dcp.writer.data_files():
                size, digest = file_digest(save.staging / name, BLOCK_SIZE)
                save.entries.append(FileEntry(name, size, digest, BLOCK_SIZE))
        except Diverged as e:
            save.error, save.diverged = f"rank {rank}: {e}", True
        except OSError as e:
            save.error = f"rank {rank}: {e.strerror or e}"
        except Exception as e:  # noqa: BLE001 - every rank must learn of it at the gather, or the others wait
            save.error = f"rank {rank}: {first_line(e, 300)}"
        save.write_seconds = time.perf_counter() - started

    def _advance(self, timeout: float | None, background: bool = True) -> bool:
        """Collective while a sharded checkpoint is in flight (``_pending`` is set and cleared at the same
        calls on every rank; without one, nothing): take it as far as every rank's threads allow within
        ``timeout`` seconds (None: to its commit). True when none is left in flight. ``background``: the
        commit runs in a thread of its own. A failure on any rank is a CheckpointWriteError on every rank."""
        if self._pending is None:
            return True
        started = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while (save := self._pending) is not None:
                if save.thread is not None:
                    save.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                alive = save.thread is not None and save.thread.is_alive()
                busy, failed = distributed.agree(alive, save.error is not None)
                if busy:
                    return False
                if not save.committing:
                    self._gather(save, background)
                else:  # committed (or failed to) by rank 0 or the node leaders
                    self._pending = None
                    if failed:
                        self._fail([e for e in distributed.all_gather(save.error) if e is not None])
            return True
        finally:  # the loop waited for this much of the save's completion
            self.last_stall_seconds = (self.last_stall_seconds or 0.0) + time.perf_counter() - started

    def _gather(self, save: _ShardedSave, background: bool) -> None:
        """Collective: every rank's written files and results; the commit starts where one is due."""
        gathered = distributed.all_gather((save.entries, save.results, save.error, distributed.node(),
                                           save.write_seconds, save.diverged))
        errors = [error for _, _, error, _, _, _ in gathered if error is not None]
        if errors:
            self._pending = None
            if distributed.node_leader():
                shutil.rmtree(save.staging, ignore_errors=True)
            diverged = [error for _, _, error, _, _, diverged in gathered if diverged]
            if diverged:  # on every rank alike: NaN in one rank's shards is the whole model's
                raise Diverged(diverged[0])
            self._fail(errors)
        save.committing, save.thread = True, None
        if save.own_disks:  # each node commits its part; the bucket commits the whole (uploader.sync)
            if not distributed.node_leader():
                return
            mine = [f for written, _, _, node, _, _ in gathered if node == distributed.node() for f in written]
        elif distributed.rank() == 0:
            mine = [f for written, *_ in gathered for f in written]
        else:
            return
        results = [written for _, written, *_ in gathered]
        spent = max(seconds for *_, seconds, _ in gathered)
        if background:
            save.thread = threading.Thread(target=self._commit_shards, args=(save, mine, results, spent),
                                           name=f"checkpoint-{save.step}-commit", daemon=True)
            save.thread.start()
        else:
            self._commit_shards(save, mine, results, spent)

    def _commit_shards(self, save: _ShardedSave, files: list[FileEntry], results: list[list[WriteResult]],
                       spent: float) -> None:
        """Rank 0 writes DCP's metadata of every rank's ``results``; then the manifest of ``files`` commits
        the checkpoint (or this node's part of it). No collective; a failure is kept in ``save.error``."""
        try:
            entries = list(files)
            if distributed.rank() == 0:
                entries.append(save.dcp.finish(results))
            meta = {**self.meta, "sharded": True}
            if save.own_disks:
                meta.update(node=distributed.node(), nodes=distributed.nodes(), save_id=save.save_id)
            manifest = Manifest(step=save.step, files=tuple(sorted(entries, key=lambda f: f.path)), timer=save.timer,
                                meta=meta)
            save.committed = self._commit(save.staging, manifest, time.perf_counter() - spent, announce=save.upload)
        except OSError as e:
            save.error = f"rank {distributed.rank()}: {e.strerror or e}"
        except Exception as e:  # noqa: BLE001 - gathered like a write's failure
            save.error = f"rank {distributed.rank()}: {first_line(e, 300)}"
        if save.error is not None:
            shutil.rmtree(save.staging, ignore_errors=True)

    def _fail(self, errors: list[str]) -> NoReturn:
        raise CheckpointWriteError(f"cannot write a sharded checkpoint to {self.folder}: {'; '.join(errors)}; "
                                   "free disk space or fix permissions (the previous checkpoint is untouched)")

    @staticmethod
    def _staging_per_node(staging: Path) -> bool:
        """Make the save's staging folder; True when the nodes have disks of their own (each node then
        commits its own part), False on one node or a volume every node shares (rank 0 commits it all).
        Told apart by looking: rank 0 makes the folder, then each node leader sees it, or not."""
        if distributed.rank() == 0:
            staging.mkdir(parents=True)
        distributed.barrier()
        own = False
        if distributed.node_leader() and distributed.rank() != 0 and not staging.exists():
            staging.mkdir(parents=True)
            own = True
        (own_disks,) = distributed.agree(own)
        return own_disks

    def _reserved(self) -> None:
        """The buffers are the snapshot's again: a capture never races the reservation."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the checkpoint in flight; re-raise its failure here, in the training thread.

        Collective (every rank calls it), and a failure is raised on every rank: rank 0's own, the
        others an OtherRankError with its exit code."""
        if self.sharded:
            return self._advance(timeout)
        done = self._join(timeout)
        distributed.raise_together(self._take_background_error() if done else None, "write its checkpoint")
        return done

    def _join(self, timeout: float | None) -> bool:
        """This rank's part of :meth:`wait`, no collective: the reservation and the write in flight."""
        if self._reserving is not None:
            self._reserving.join(timeout)
            if self._reserving.is_alive():
                return False
            self._reserving = None
        if self._writer is not None:
            if self._deferred is not None:
                # Its verdict now, copies done or not: a caller of wait or close writes no source before the writer
                # is done (it joins it, or it is stopping and leaves a timed-out write to finish on its own).
                self._settle()
            self._writer.join(timeout)
            if self._writer.is_alive():
                return False
            self._writer = self._deferred = None
        return True

    def close(self, timeout: float | None = None) -> bool:
        """On the way out after a failure: let the write in flight finish (it commits or cleans up after
        itself), keeping the failure that is already on its way to the user; its own error is logged.

        A process that exits while this thread is inside torch.save is aborted by the C++ runtime
        ("terminate called without an active exception"), losing the documented exit code.
        Sharded: this rank's thread alone, without a collective (the other ranks may not be here); an
        unfinished sharded save stays in its staging folder, which the next start removes.
        """
        if self.sharded:
            thread = self._pending.thread if self._pending is not None else None
            if thread is not None:
                thread.join(timeout)
            return thread is None or not thread.is_alive()
        done = self._join(timeout)  # no collective: the other ranks may be on their way out already
        error = self._take_background_error()
        if error is not None:  # the caller is already raising the first failure
            logger.warning("the checkpoint in flight failed too: %s", error)
        return done

    def _take_background_error(self) -> BaseException | None:
        error, self._error = self._error, None
        return error

    def _write_in_background(self, tree: Any, ready: Any, deferred: Deferred, step: int,
                             timer: dict[str, int], parameters: set[str]) -> None:
        try:
            _yield_cpu_to_training()  # the copy too: before_update takes over what is left of it
            if not deferred.run():
                return  # a copy failed in the training thread and was raised there: nothing whole to write
            if deferred.found_stale():
                return  # discarded before a byte is written (the training thread settled it already)
            if ready is not None:
                ready.synchronize()
            self._write(tree, step, timer, parameters, settled=deferred.wait_settled)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()/save_async()
            self._error = e

    def _write(self, tree: Any, step: int, timer: dict[str, int], parameters: set[str],
               settled: Callable[[], bool] | None = None) -> local.LocalCheckpoint | None:
        """Serialize, hash, fsync and commit; on any OSError the previous checkpoints stay as they were.
        ``settled``: False when the snapshot turned out stale (job.snapshot): then nothing is committed.
        ``parameters``: the model entries of ``tree`` that are parameters (Diverged, before a byte is written)."""
        started = time.perf_counter()  # the check is part of the write: a preemption's estimate counts it too
        self._refuse_diverged(tree, parameters, step)
        staging: Path | None = None
        try:
            staging = local.staging_dir(self.folder, step)
            manifest = Manifest(step=step, files=(_write_file(staging / STATE_FILE, tree),), timer=timer, meta=self.meta)
            if settled is not None:
                waited = time.perf_counter()
                fresh = settled()
                started += time.perf_counter() - waited  # the wait for the next step is no part of the write
                if not fresh:
                    shutil.rmtree(staging, ignore_errors=True)
                    return None
            return self._commit(staging, manifest, started)
        except OSError as e:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointWriteError(
                f"cannot write a checkpoint to {self.folder}: {e.strerror or e}; free disk space or fix "
                "permissions (the previous checkpoint is untouched)"
            ) from None

    def _refuse_diverged(self, tree: Any, parameters: set[str], step: int) -> None:
        """Diverged when the parameters or the optimizer state in ``tree`` hold NaN or Inf, or its loss scale
        backed off to 0 (state.finite)."""
        bad = first_nonfinite(trained_tensors(tree, parameters))
        scale = collapsed_loss_scale(tree) if bad is None else None
        if bad is None and scale is None:
            return
        what = (f"{bad} holds NaN or Inf" if bad is not None else f"the loss scale (--precision amp_fp16, "
                f"{scale[0]}) is {scale[1]:g}, and from there every step overflows")
        kept = local.list_committed(self.folder)
        newest = f"newest in {self.folder}: step {kept[-1].step}" if kept else f"none in {self.folder}"
        raise Diverged(f"training diverged at step {step}: {what}; that checkpoint is not written, and the ones before "
                       f"it are kept ({newest}); resume the newest good one with a change (a lower --lr, for one): "
                       "with the same flags the same steps diverge again")

    def announce(self, step: int) -> None:
        """Hand the checkpoint of ``step`` to ``on_commit`` (the upload) if this process committed it
        without (a save taken while a node was still uploading, _begin_sharded): the one a run ends on
        always goes up. Nothing for any other step: one handed over already, or never committed here."""
        held = self._held_back
        if held is None or held.step != step or self.on_commit is None:
            return
        self._held_back = None
        self.on_commit(held)  # the newest committed checkpoint: retention never prunes it

    def _commit(self, staging: Path, manifest: Manifest, started: float,
                announce: bool = True) -> local.LocalCheckpoint:
        """Manifest last, rename, prune, report (to ``on_commit`` too, when ``announce``: the upload): the
        checkpoint counts from here on."""
        ckpt = local.commit(staging, manifest)
        self.last_committed = manifest.step
        with self._retention:
            if not self._retention_frozen:
                local.prune(self.folder, self.keep, manifest.step, protect=self.protect())
        self.last_write_seconds = time.perf_counter() - started
        # "stall": how long the training loop was blocked for this checkpoint, as far as known at its commit.
        # A durable save(): the whole save up to here (not the wait for the one in flight before it). An
        # asynchronous one: its copy in save_async plus before_update's wait for the pipelined copy, which ends
        # before the write starts (counted by the training thread as it wakes, long before this commit).
        # Sharded: the copy and plan plus the gathers before the commit; the loop's wait in the gather call
        # that sees the commit end is not in it (it is in last_stall_seconds).
        since = self._durable_since
        stall = time.perf_counter() - since if since is not None else self.last_stall_seconds
        event(logger, "checkpoint", step=manifest.step, path=str(ckpt.path), bytes=manifest.total_size,
              seconds=round(self.last_write_seconds, 3), stall=None if stall is None else round(stall, 3))
        if self.on_commit is not None and announce:
            self._held_back = None  # an older one held back is not worth an upload after this one
            self.on_commit(ckpt)
        elif self.on_commit is not None:
            self._held_back = ckpt  # only the newest matters: the run may end on it (announce)
            logger.debug("%s stays local: a node was still uploading when it was taken", ckpt.name)
        return ckpt

    def newest(self) -> tuple[local.LocalCheckpoint, Manifest] | None:
        """The checkpoint to resume from at start-up; the ones newer than it that fail verification are
        set aside (uploader.local.set_aside), so they are never chosen, counted or pruned again."""
        local.clean_staging(self.folder)
        return local.newest_verified(self.folder, set_aside_corrupt=True)


@dataclass
class _ShardedSave:
    """One sharded checkpoint on its way (Checkpointer's docstring): copied and planned in the training
    thread, written by each rank's thread, gathered back in the training thread, committed by rank 0 (or
    each node leader) in a thread of its own."""

    step: int
    save_id: str
    staging: Path
    own_disks: bool  # each node commits its own part (Checkpointer._staging_per_node)
    upload: bool  # handed to on_commit: on own disks, only saves every node's uploader was free for
    timer: dict[str, int]
    files: dict[str, Any]  # this rank's plain torch files by name: its own state; on rank 0 the replicated state
    dcp: dcp_storage.PlannedSave
    ready: list[torch.cuda.Event]  # device copies into the host buffers, synchronized before the write
    shards: dict[str, Any]  # what dcp writes: this rank's shards (their host copies, for a write in the background)
    parameters: set[str]  # the model entries of ``shards`` that are parameters (state.finite)
    thread: threading.Thread | None = None  # this rank's part now running: its write, then (rank 0) the commit
    committing: bool = False  # written and gathered: the commit runs, or has run
    entries: list[FileEntry] = field(default_factory=list)
    results: list[WriteResult] = field(default_factory=list)
    error: str | None = None  # this rank's failure, told to every rank at the next gather
    diverged: bool = False  # that failure is NaN or Inf in this rank's shards (Diverged on every rank)
    write_seconds: float = 0.0
    committed: local.LocalCheckpoint | None = None


def claim_folder(folder: Path) -> None:
    """Fail at start-up, not at the first save one interval later, when ``folder`` cannot be written;
    clear an older run's FINISHED marker (a job that starts is not finished: uploader.watch); and
    remove what saves that died half-way left (uploader.local.clean_staging). Every process that writes
    to the folder claims it before anything is written, so no save or pull of this start is under way:
    on nodes with disks of their own, each node's leader, whose folder no other start-up looks at.

    Nothing is left here: a folder that does not exist yet is judged by the nearest one above it that
    does (a folder made and removed there), and made by the first save or pull, so a run refused for a
    bad flag leaves no trace.
    """
    try:
        existing = local.nearest_existing(folder)  # a folder above it this user may not enter: EACCES
        # A folder made and removed there says it for sure, in the system's words (ENOTDIR, EACCES, EROFS):
        # os.access says yes to root everywhere, and /proc, /sys or a FUSE mount still refuse root (a whole run
        # trained into /proc/x, then failed its first save). Staging-named, so that a process killed in between
        # leaves nothing a start keeps; another node leader's clean_staging on a shared folder may remove it
        # first (FileNotFoundError): made is enough.
        probe = existing / f"{local.STAGING_PREFIX}write-check-{uuid.uuid4().hex[:8]}"
        probe.mkdir()
        with contextlib.suppress(FileNotFoundError):
            probe.rmdir()
        local.clear_finished(folder)
        local.clean_staging(folder)
    except OSError as e:
        raise CheckpointWriteError(
            f"cannot write checkpoints to {folder}: {e.strerror or e}; make it writable for this user "
            f"(uid {os.getuid()}) or choose another --save-folder (existing checkpoints are untouched)"
        ) from None


def check_nodes_can_resume(folder: Path, remote: bool, uploads: bool) -> None:
    """A sharded run on several nodes whose folders are disks of their own keeps only each node's part
    of a checkpoint on each disk; the parts meet in the bucket alone (README, "Multi-node without a
    shared volume"). Without --remote nothing it saves could ever be resumed: refused at start-up, not
    found out at the first restart. With --upload off (read-only credentials, a resume-only benchmark)
    only what the bucket holds can be: a warning. Every rank calls this (collectives); it looks as the
    saves do."""
    if uploads or distributed.nodes() == 1:
        return
    probe = folder / f"{local.STAGING_PREFIX}nodes-{distributed.broadcast_choice(uuid.uuid4().hex)}"
    distributed.barrier()  # every node leader has claimed (cleaned) the folder: the probe stays until removed here
    try:
        own_disks = Checkpointer._staging_per_node(probe)
    finally:
        if distributed.node_leader():
            shutil.rmtree(probe, ignore_errors=True)
    if own_disks and not remote:
        raise ConfigError(
            f"--sharded on {distributed.nodes()} nodes whose --save-folder {folder} is a disk of each node's own "
            "needs --remote: each node keeps only its part of a checkpoint, and a part alone is never resumed; "
            "add --remote s3://bucket/prefix, or give every node one shared volume")
    if own_disks and distributed.rank() == 0:
        logger.warning("--upload off on %d nodes with disks of their own: this run's checkpoints stay in parts on "
                       "each node, which are never resumed; a restart resumes the newest in the bucket",
                       distributed.nodes())


def _yield_cpu_to_training() -> None:
    """Lower this thread's CPU priority: a background write must take the cores training leaves idle,
    not share them half and half with the training thread (its copies, serialization and BLAKE3 are CPU
    work). On Linux a nice value is per thread (setpriority on the thread id)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
    except (AttributeError, OSError):  # not Linux, or not allowed: the write just competes as before
        logger.debug("cannot lower the checkpoint writer's priority", exc_info=True)


_crc32_lock = threading.Lock()
_crc32_saves = 0  # the job's saves now running with torch's CRC-32 off
_crc32_before = True  # torch's setting before the first of them


@contextmanager
def _without_torch_crc32() -> Iterator[None]:
    """torch.save computes a CRC-32 of every record: a fifth of a background write's CPU (17 of 70 ms
    per 100 MB here), taken from training on busy cores. Checkpoint files are BLAKE3-verified end to end,
    and torch.load does not need the CRC, so the job's saves skip it. torch reads the setting when a
    save starts; saves may overlap (the writer thread and a rank's sharded write), so it stays off
    while any runs, and the setting from before (a user's own torch.save) comes back after the last."""
    global _crc32_saves, _crc32_before
    with _crc32_lock:
        if _crc32_saves == 0:
            _crc32_before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)
        _crc32_saves += 1
    try:
        yield
    finally:
        with _crc32_lock:
            _crc32_saves -= 1
            if _crc32_saves == 0:
                torch.serialization.set_crc32_options(_crc32_before)


def _write_file(path: Path, tree: Any) -> FileEntry:
    """torch.save ``tree`` to ``path`` around the page cache (job.direct_file), hashed while written,
    fsynced: its manifest entry."""
    with DirectFile(path) as raw, _without_torch_crc32():
        writer = HashingWriter(raw)
        _save(tree, writer)
        raw.sync()
    return FileEntry(path.name, writer.size, writer.hexdigest(), writer.block_size)


def _save(tree: Any, writer: HashingWriter) -> None:
    """torch.save into a hashing writer, surfacing the real I/O error (torch.save replaces it with a
    RuntimeError while closing its zip writer)."""
    try:
        torch.save(tree, writer)
    except RuntimeError:
        if writer.error is None:
            raise
        raise writer.error from None


def open_checkpoint(path: Path) -> tuple[Path, Manifest]:
    """A checkpoint folder given by the user (``--resume PATH``, ``job inspect``), verified.

    A folder of checkpoints is accepted too: its newest verified checkpoint is used.
    """
    if not path.is_dir():
        raise CheckpointLoadError(f"{path} is not a checkpoint folder (expected a folder with manifest.json)")
    if not (path / "manifest.json").is_file():
        found = local.newest_verified(path)
        if found is None:
            raise CheckpointLoadError(f"{path} holds no complete checkpoint (no folder with a valid manifest.json)")
        return found[0].path, found[1]
    try:
        manifest = Manifest.read(path)
        manifest.verify(path)
    except (CorruptCheckpoint, ManifestError) as e:
        raise CheckpointLoadError(f"checkpoint {path} is unusable: {e}") from None
    return path, manifest


def load_state_file(folder: Path, manifest: Manifest | None = None) -> dict[str, Any]:
    """The whole state of a checkpoint in ``state.pt``'s layout, never executing code: ``state.pt``
    loaded with ``weights_only=True``, or, when ``manifest`` says it is sharded, the shards reassembled
    by torch.distributed.checkpoint (job.sharded) with every rank's own state under ``per_rank``."""
    if manifest is None or not manifest.meta.get("sharded"):
        return _load(folder / STATE_FILE)
    from job import dcp_storage, sharded
    metadata = dcp_storage.read_metadata(folder, manifest)
    return {**_load(folder / REPLICATED_FILE), **sharded.full_tree(folder, metadata),
            distributed.PER_RANK: per_rank_states(folder, manifest)}


def per_rank_states(folder: Path, manifest: Manifest) -> list[dict[str, Any]]:
    """Each rank's own state (``rng``, ``train_metrics``) of the run that wrote a sharded checkpoint, in
    rank order: what job.elastic hands over to the ranks of this run."""
    found = sorted((int(m.group(1)), m.string) for m in (RANK_FILE_RE.fullmatch(f.path) for f in manifest.files) if m)
    return [{k: _load(folder / name).get(k) for k in distributed.PER_RANK_KEYS} for _, name in found]


def _load(path: Path) -> dict[str, Any]:
    """``mmap=True``: tensors map the file's pages (already in the page cache after a write or a pull)
    instead of being read into fresh memory; load_state_dict then copies each once into the model.
    Committed files are never modified in place (only deleted), so the mapping stays valid."""
    loaded = load_weights_only(path, f"checkpoint file {path}", mmap=True)
    if not isinstance(loaded, dict):
        raise CheckpointLoadError(f"{path} does not hold a state dict")
    return loaded


def check_settings(manifest: Manifest, meta: dict[str, Any]) -> None:
    """Warn when the run's settings differ from the ones the checkpoint was made with."""
    for key in RESULT_SETTINGS:
        old, new = manifest.meta.get(key), meta.get(key)
        if old is not None and old != new:
            logger.warning("resuming with %s=%r, the checkpoint was made with %r: the result will differ "
                           "from an uninterrupted run", key, new, old)
    old_world, world = manifest.meta.get("world_size"), meta.get("world_size")
    if old_world is not None and old_world != world:
        logger.warning("resuming on %s rank(s), the checkpoint was written by %s: the same global batches in the "
                       "same order, so the result is close to, not bit for bit, an uninterrupted run", world, old_world)


def load_shard(folder: Path, manifest: Manifest, state: State) -> dict[str, Any]:
    """Collective, every rank of a sharded (FSDP2) run: load the checkpoint's model and optimizers into
    ``state``, each rank its shards of them, whatever the number of ranks or whether the checkpoint is
    sharded (DCP reshards; a ``state.pt``'s full tensors are split). Returns the checkpoint's state dict
    for State.load_state_dict, with ``per_rank`` for job.elastic; its model and optimizers stand for the
    ones just loaded. The folder must be visible to every rank.

    A file one rank cannot use is a CheckpointLoadError on every rank, before any of them loads.
    """
    from job import dcp_storage, sharded
    tree: dict[str, Any] | None = None
    metadata = None
    error: str | None = None
    try:
        if manifest.meta.get("sharded"):
            metadata = dcp_storage.read_metadata(folder, manifest)
            tree = {**_load(folder / REPLICATED_FILE), distributed.PER_RANK: per_rank_states(folder, manifest)}
        else:
            tree = _load(folder / STATE_FILE)
    except CheckpointLoadError as e:
        error = str(e)
    errors = [e for e in distributed.all_gather(error) if e is not None]
    if errors:
        raise CheckpointLoadError(errors[0] if error is not None else
                                  f"{errors[0]} (seen by another rank: the folder must be visible to every rank)")
    assert tree is not None
    if metadata is not None:
        return {**tree, **sharded.load_resharded(state, folder, metadata)}
    return sharded.load_full_state(state, tree, str(folder))


def model_sha256(model_state: dict[str, Any]) -> str:
    """sha256 over the model's tensors in name order: equal hashes mean bit-identical weights."""
    digest = hashlib.sha256()
    for name in sorted(model_state):
        tensor = model_state[name]
        digest.update(name.encode())
        if isinstance(tensor, torch.Tensor):
            t = tensor.detach().cpu().contiguous()
            digest.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
            digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _fingerprint(folder: Path, model_state: Any) -> str:
    """model_sha256 of a checkpoint's model entry, which is untrusted: anything but a mapping by names, or
    a tensor it cannot read (sparse), is a damaged checkpoint (exit 6), as it would be for a resume."""
    if not isinstance(model_state, dict) or not all(isinstance(k, str) for k in model_state):
        raise CheckpointLoadError(f"{folder}: its model entry is not a mapping of names to tensors: it is damaged")
    try:
        return model_sha256(model_state)
    except (RuntimeError, TypeError, ValueError) as e:
        raise CheckpointLoadError(f"{folder}: its model entry cannot be read ({first_line(e)}): it is "
                                  "damaged") from None


def describe(folder: Path, manifest: Manifest) -> dict[str, Any]:
    """What ``job inspect`` prints: the position in training and a fingerprint of the weights."""
    if manifest.meta.get("sharded"):  # DCP reassembles the full tensors of any sharding
        from job import dcp_storage, sharded
        loaded = sharded.full_tree(folder, dcp_storage.read_metadata(folder, manifest), keys=[MODEL])
    else:
        loaded = load_state_file(folder)
    timer = manifest.timer
    return {
        "path": str(folder),
        "format_version": manifest.format_version,
        "step": manifest.step,
        "epoch": timer.get("epoch"),
        "batch_in_epoch": timer.get("batch_in_epoch"),
        "samples": timer.get("sample"),
        "tokens": timer.get("token"),
        "bytes": manifest.total_size,
        "created": manifest.created,
        "model_sha256": _fingerprint(folder, loaded.get("model", {})),
        "meta": manifest.meta,
    }
