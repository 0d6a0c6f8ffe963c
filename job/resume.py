"""Where a job resumes from: the choice among local and remote checkpoints (rank 0), the refusals that
keep a run's work (exit 6 when nothing verifies, exit 2 for a second run on one prefix), and loading the
chosen one on every rank, on every node, with what was per rank handed over by job.elastic.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from torch.distributed.device_mesh import DeviceMesh

from job import distributed, elastic, node_pull
from job.checkpoint import STATE_FILE, Checkpointer, check_settings, load_shard, load_state_file, open_checkpoint
from job.config import CheckpointConfig
from job.exceptions import CheckpointLoadError, ConfigError
from job.logs import event
from job.restore import own_settings, restore
from job.storage import Pull, RemoteStore
from state import State
from uploader import local
from uploader.local import LocalCheckpoint
from uploader.manifest import Manifest

logger = logging.getLogger(__name__)


def expects_checkpoint(cfg: CheckpointConfig, store: RemoteStore | None) -> bool:
    """Whether this start will probably load a checkpoint, so that job.build may leave the model
    uninitialised: --resume PATH, or a bucket or local checkpoints to resume from."""
    if cfg.resume == "never":
        return False
    return cfg.resume != "auto" or store is not None or bool(local.list_committed(cfg.folder))


def choose(cfg: CheckpointConfig, checkpointer: Checkpointer, store: RemoteStore | None,
           pulling: Pull[LocalCheckpoint | None] | None = None) -> tuple[Path, Manifest, str] | None:
    """The checkpoint to resume from (rank 0 only): --resume PATH, or the newest of local and remote.

    ``pulling`` is the remote pull started before the model was built (RemoteStore.start_pull).
    """
    if cfg.resume == "never":  # check_new_run made sure that nothing is there to be mixed with
        return None
    if cfg.resume != "auto":  # the run has no checkpoint of its own yet (seeded_or_own)
        folder, manifest = open_checkpoint(Path(cfg.resume))
        return folder, manifest, str(folder)
    if pulling is None and store is not None:
        pulling = store.start_pull(cfg.folder)
    pulled = pulling.result() if pulling is not None else None
    if store is not None and pulled is not None:
        return _resume_from_pull(store, pulled)
    # A node's part of a multi-node checkpoint is never resumed alone, nor a checkpoint that failed: not counted.
    committed = [c for c in local.list_committed(cfg.folder) if not local.is_node_part(c)]
    found = checkpointer.newest()  # sets aside the newer ones that fail verification
    if store is not None and committed and (found is None or found[0].step < committed[-1].step):
        # The newest local checkpoint is corrupt (a pull torn by a power cut: pulls are not fsynced)
        # and was skipped: the bucket may still hold it, or something newer than the older local one.
        pulled = store.start_pull(cfg.folder, than=found[0].step if found is not None else -1).result()
        if pulled is not None:
            return _resume_from_pull(store, pulled)
    if found is None:
        _refuse_to_start_over(cfg, committed, store)
        return None
    ckpt, manifest = found
    return ckpt.path, manifest, str(ckpt.path)


def seeded_or_own(cfg: CheckpointConfig, store: RemoteStore | None) -> CheckpointConfig:
    """Collective: ``cfg`` as every rank resumes by it. ``--resume PATH`` seeds a run, as Composer's
    ``load_path`` does beside autoresume: once the run has a checkpoint of its own in --save-folder or the
    bucket (even one set aside as corrupt), it resumes as with ``--resume auto``.

    Why: a restart with the same flags (Kubernetes keeps JOB_RESUME) went back to PATH every time and
    trained every step since again (review 48); and a run whose own checkpoints fail verification is not
    silently started over from PATH either: that exits 6, as it does with ``auto``. Decided by rank 0, so a
    multi-node resume takes the same path on every rank (job.node_pull)."""
    if cfg.resume in ("auto", "never"):
        return cfg
    own = distributed.decided_by_first(partial(_own_checkpoints, cfg, store), "look for the run's own checkpoints")
    if own is None:
        return cfg
    where, newest = own
    if distributed.rank() == 0 and (newest is None or Path(cfg.resume).resolve() != newest):
        logger.warning("--resume %s is not used: %s already holds checkpoints of this run, and a restarted run goes "
                       "on from its own newest; to start again from %s, use a new --save-folder (and --remote "
                       "prefix)", cfg.resume, where, cfg.resume)
    return replace(cfg, resume="auto")


def _own_checkpoints(cfg: CheckpointConfig, store: RemoteStore | None) -> tuple[str, Path | None] | None:
    """Where the run's own checkpoints are (committed, or set aside as corrupt), and its newest local one;
    None where --save-folder and --remote hold none. Unverified: ``auto`` verifies what it resumes."""
    committed = [c for c in local.list_committed(cfg.folder) if not local.is_node_part(c)]
    if committed or local.list_set_aside(cfg.folder):
        return str(cfg.folder), committed[-1].path.resolve() if committed else None
    if store is not None and store.holds_checkpoints():
        return store.url, None
    return None


def _refuse_to_start_over(cfg: CheckpointConfig, committed: list[LocalCheckpoint], store: RemoteStore | None) -> None:
    """Nothing verifies: when the run has a history (checkpoints that failed verification, now or at an
    earlier start), starting from step 0 would silently throw that work away; say so (exit 6) instead."""
    failed = []
    if committed:
        failed.append(f"none of the {len(committed)} checkpoint(s) in {cfg.folder} verifies")
    elif local.list_set_aside(cfg.folder):
        failed.append(f"the checkpoints in {cfg.folder} failed verification (set aside as corrupt-step-*)")
    if store is not None and store.holds_checkpoints():
        failed.append(f"none in {store.url} verifies (the ones that failed are set aside as corrupt-step-* "
                      "where the credentials allow)")
    if failed:
        raise CheckpointLoadError(
            f"{'; '.join(failed)} (see the warnings above): restore a good checkpoint, or pass --resume never "
            "to start again from step 0")


def check_new_run(cfg: CheckpointConfig, store: RemoteStore | None) -> None:
    """``--resume never`` starts a new run: refused where an earlier run's checkpoints would be mixed with
    its own (they would stay newest, and the next start would resume them). One run per folder and
    prefix; checkpoints set aside as corrupt do not count, they are never chosen."""
    committed = local.list_committed(cfg.folder)
    if committed:
        raise ConfigError(
            f"--resume never: {cfg.folder} already holds checkpoints of a run (newest step {committed[-1].step}); "
            "a new run needs its own --save-folder: choose another one, or move these away first")
    steps = store.complete_steps() if store is not None else []
    if store is not None and steps:
        raise ConfigError(
            f"--resume never: {store.url} already holds checkpoints of a run (newest step {steps[-1]}); a new run "
            "needs a new --remote prefix (one run per prefix): choose one, or delete that prefix first")


def _resume_from_pull(store: RemoteStore, pulled: LocalCheckpoint) -> tuple[Path, Manifest, str]:
    # Verified byte for byte while it streamed to disk: hashing it again would only delay the resume.
    return pulled.path, pulled.manifest(), store.describe(pulled)


class Resumed(NamedTuple):
    """The checkpoint a run resumed: its manifest's meta, from which the caller plans the global batch, and
    where it came from, which the caller's errors about it name. ``own``: it is one of this run's, in
    --save-folder or the bucket; not a --resume PATH elsewhere, of which the run still has to save a copy
    (job.app: the checkpoint at the end, or at a stop before the first step, is then written here)."""

    meta: dict[str, Any]
    source: str
    own: bool = True


def resume(state: State, cfg: CheckpointConfig, checkpointer: Checkpointer, meta: dict[str, Any],
           store: RemoteStore | None, mesh: DeviceMesh | None = None,
           pulling: Pull[LocalCheckpoint | None] | None = None) -> Resumed | None:
    """Rank 0 chooses and reads the checkpoint; every rank loads the same one, with what was per rank
    handed over by job.elastic (on another number of ranks too). None when there is nothing to resume.

    In a sharded run every rank reads its part of the chosen checkpoint itself (DCP reshards it to this
    run's ranks). Otherwise, on one node, every rank maps the chosen ``state.pt`` itself (the same file,
    the same page cache, checked by its identity); on several nodes, or for a sharded checkpoint, rank 0
    reads the whole state (a sharded checkpoint reassembled) and broadcasts it. A sharded run on several
    nodes resumes a newer checkpoint from the bucket with each node downloading only what its ranks read
    (job.node_pull).
    """
    own = own_settings(state)  # before a sharded read loads the checkpoint's optimizer settings into state
    cfg = seeded_or_own(cfg, store)
    loaded = None
    if mesh is not None and distributed.nodes() > 1 and cfg.resume == "auto":
        found = node_pull.resume_from_bucket(state, cfg.folder, store, _newest_whole_local(cfg.folder), meta)
        if found is not None:
            tree, manifest, source = found
            loaded = (lambda: tree, source, manifest.meta, manifest.step, manifest.timer, True)  # the bucket's
    if loaded is None:
        loaded = _load_chosen(state, cfg, checkpointer, meta, store, mesh, pulling)
    if loaded is None:
        return None
    read, source, ckpt_meta, step, timer, ours = loaded
    error: str | None = None
    try:  # what is per rank can be damaged for one rank only: every rank refuses it, none trains on alone
        tree = read()
        handover = elastic.for_this_rank(tree, distributed.rank(), distributed.world_size(),
                                         seed=state.rank_zero_seed, step=step, source=source)
        restore(state, handover.tree, source, step, timer, then=handover.finish, own=own)
    except CheckpointLoadError as e:
        error = str(e)
    errors = [e for e in distributed.all_gather(error) if e is not None]
    if errors:
        raise CheckpointLoadError(error or f"{errors[0]} (seen by another rank)")
    return Resumed(ckpt_meta, source, ours)


def announce(state: State, resumed: Resumed) -> None:
    """The ``resumed`` event, once the run has accepted the checkpoint's plan too (job.elastic): a checkpoint
    whose global batch this number of ranks cannot divide is refused after it loaded, and was counted resumed."""
    event(logger, "resumed", step=state.timer.batch.value, epoch=state.timer.epoch.value, source=resumed.source,
          world_size_was=resumed.meta.get("world_size"), world_size=distributed.world_size())


def _newest_whole_local(folder: Path) -> int:
    """The step of the newest whole checkpoint in ``folder`` (unverified: only to compare with the bucket)."""
    if distributed.rank() != 0:
        return -1  # rank 0 decides
    return max((c.step for c in local.list_committed(folder) if not local.is_node_part(c)), default=-1)


def _load_chosen(state: State, cfg: CheckpointConfig, checkpointer: Checkpointer, meta: dict[str, Any],
                 store: RemoteStore | None, mesh: DeviceMesh | None, pulling: Pull[LocalCheckpoint | None] | None,
                 ) -> tuple[Callable[[], Any], str, dict[str, Any], int, dict[str, int], bool] | None:
    """The checkpoint rank 0 chooses: how this rank reads its state dict (inside resume's agreement on
    errors: a rank that cannot read it refuses it for all), where it came from, its meta, step and timer,
    and whether it is in --save-folder (Resumed.own)."""
    def decide() -> tuple[str, str, Manifest, Any, str, bool] | None:
        chosen = choose(cfg, checkpointer, store, pulling)
        if chosen is None:
            return None
        folder, manifest, source = chosen
        check_settings(manifest, meta)
        # Sharded run: every rank reads its part from the folder, resharded by DCP (job.sharded). A state.pt
        # on one node: every rank maps it. Otherwise rank 0 reads the whole state (a sharded checkpoint
        # reassembled) and broadcasts it: pickled, copied into each rank, twice the state in flight.
        kind = ("sharded" if mesh is not None else
                "file" if distributed.nodes() == 1 and not manifest.meta.get("sharded") else "full")
        identity = file_identity(folder / STATE_FILE) if kind == "file" else None
        # After seeded_or_own a PATH is left only where --save-folder holds no checkpoint: auto's choice is always
        # one of the folder's (local, or pulled into it), PATH's never.
        return kind, str(folder), manifest, identity, source, cfg.resume == "auto"

    loaded = distributed.decided_by_first(decide, "choose the checkpoint to resume")
    if loaded is None:
        return None
    kind, where, manifest, identity, source, own = loaded
    folder = Path(where)
    if kind == "sharded" and distributed.nodes() > 1:  # every node reads the whole from its own disk
        failed: Exception | None = None
        if distributed.node_leader() and distributed.rank() != 0:
            try:
                _whole_on_this_node(store, folder.parent, manifest.step, source, pulling)
            except Exception as e:  # noqa: BLE001 - raised on every rank by raise_together, with its exit code
                failed = e
        # Not a barrier: a node's failure or stop (exit 75) ends every rank with its code, not rank 0 with a bug.
        distributed.raise_together(failed, "bring the checkpoint to its node")
    if kind == "sharded":
        read: Callable[[], Any] = partial(load_shard, folder, manifest, state)
    elif kind == "file" and not distributed.agree(file_identity(folder / STATE_FILE) != identity)[0]:  # all ranks
        read = partial(load_state_file, folder, manifest)
    else:
        if kind == "file":  # a rank that sees another file there, or none, is on another machine after all (a
            # launcher without LOCAL_WORLD_SIZE, or nodes of different sizes): rank 0 sends it, as across nodes
            logger.warning("not every rank sees the checkpoint file rank 0 chose (%s): rank 0 sends it", source)
        read = _sent_by_first(folder, manifest)
    return read, source, manifest.meta, manifest.step, manifest.timer, own


def _sent_by_first(folder: Path, manifest: Manifest) -> Callable[[], Any]:
    """Rank 0 reads the state and sends it to every rank (collective); its failure to read it is sent too,
    and raised by every rank inside resume's agreement, where it would otherwise leave the others waiting."""
    sent: Any = None
    if distributed.rank() == 0:
        try:
            sent = load_state_file(folder, manifest)
        except CheckpointLoadError as e:
            sent = e
    got = distributed.broadcast_choice(sent)

    def read() -> Any:
        if isinstance(got, CheckpointLoadError):
            raise got
        return got
    return read


def file_identity(path: Path) -> tuple[int, int, int, int] | None:
    """Which file ``path`` is (device, inode, size, modification time): the same on every rank that sees
    the one rank 0 chose; None where there is none."""
    try:
        found = path.stat()
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns


def _whole_on_this_node(store: RemoteStore | None, folder: Path, step: int, source: str,
                        pulling: Pull[LocalCheckpoint | None] | None) -> None:
    """The whole checkpoint rank 0 chose, in this node's folder: already there (a shared volume, or
    this node's own start-up pull, which ran alongside rank 0's), else pulled from the remote now."""
    if pulling is not None:
        pulling.result()  # the same folder: never two pulls at once
    pulled = store.pull_step(folder, step) if store is not None else None
    if pulled is None and not any(c.step == step and not local.is_node_part(c) for c in local.list_committed(folder)):
        raise CheckpointLoadError(
            f"checkpoint {source} is not on this node ({folder}) and no --remote has it: a sharded checkpoint "
            "written on several nodes resumes through --remote, or from a --save-folder every node shares")
