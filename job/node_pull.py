"""Resuming a sharded checkpoint on several nodes without a shared volume: each node downloads only the
files its own ranks read, every node at once, and no node downloads for another.

For the newest complete checkpoint in the bucket (rank 0 names it; every rank parses its manifest):

1. Each node leader downloads DCP's JSON metadata (small) into a scratch folder of its own,
   ``.resume-node-K`` in its --save-folder.
2. Every rank asks DCP's load planner which data files hold the stored chunks that overlap its shards
   in this run (job.sharded.files_read); each node leader downloads the union of its node's ranks,
   with the small files every rank reads (the replicated state, and every rank's own state, which
   job.elastic hands over on any number of ranks), without waiting for the other nodes. Ranks on one
   node share that one download. An unsharded checkpoint (``state.pt``) is read whole.
3. Every file is verified byte for byte as it streams (the manifest's block digests), as any pull is.
   A checkpoint with a file that fails on any node is set aside by rank 0 (uploader.sync) and every
   node tries the one before; any other failure fails every rank, none left waiting in a collective.
4. DCP loads each rank's shards from its node's scratch folder (job.checkpoint.load_shard), which is
   then deleted: it is never a committed checkpoint, since it does not hold every file.
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from job import distributed
from job.checkpoint import check_settings, load_shard
from job.exceptions import CheckpointLoadError, OtherRankError, exit_code_for
from job.logs import event
from job.storage import RemoteStore
from state import State
from uploader.exceptions import CorruptCheckpoint, ManifestError
from uploader.local import checkpoint_name
from uploader.manifest import DCP_METADATA, RANK_FILE_RE, REPLICATED_FILE, Manifest

logger = logging.getLogger(__name__)


def scratch_folder(folder: Path) -> Path:
    """This node's download folder for a resume (per node, so that a folder shared by nodes works too)."""
    return folder / f".resume-node-{distributed.node()}"


def resume_from_bucket(state: State, folder: Path, store: RemoteStore | None, newer_than: int,
                       meta: dict[str, Any]) -> tuple[dict[str, Any], Manifest, str] | None:
    """Collective, every rank: load the newest complete remote checkpoint newer than step ``newer_than``
    (rank 0's newest whole local one) into ``state``'s model and optimizers, each node downloading what
    its ranks read (module docstring). Returns the checkpoint's state dict for State.load_state_dict,
    its manifest and where it came from; None when the bucket has nothing newer that verifies (the
    caller then resumes as on one node: from the local folder, or refuses to start over).

    ``store`` is required on every node leader (each uploads its own part, job.app) and on rank 0.
    """
    below: int | None = None
    while True:
        def newest(below: int | None = below) -> bytes | None:
            found = store.newest_complete(below) if store is not None else None
            return found.to_json() if found is not None and found.step > newer_than else None

        # Rank 0's failure (AuthError, UnsupportedFormat, ...) reaches every rank with its exit code: an outage
        # (5) is not a bad checkpoint (6), and no rank is left waiting for rank 0.
        raw = distributed.decided_by_first(newest, "read the bucket")
        if raw is None:
            return None
        manifest = Manifest.from_json(raw)  # rank 0 parsed the same bytes: it cannot fail here alone
        if distributed.rank() == 0:
            check_settings(manifest, meta)
        scratch = scratch_folder(folder)
        try:
            failure = _download_for_node(state, store, manifest, scratch)
            tree = load_shard(scratch, manifest, state) if failure is None else None
            # Every rank of the node is done with the scratch folder. Only on the way on: after a failure or a
            # stop, a rank may be gone (every rank ends a wait one of them left or failed: job.leavable), and
            # gloo would hold the others in C++; the job ends, and the next start removes what is left.
            distributed.barrier()
        finally:
            if distributed.node_leader():
                shutil.rmtree(scratch, ignore_errors=True)
        if failure is not None:
            if distributed.rank() == 0 and store is not None:
                store.set_aside(manifest, failure)
            below = manifest.step
            continue
        where = store.url.rstrip("/") if store is not None else "the bucket"
        return tree, manifest, f"{where}/{checkpoint_name(manifest.step)}"


def _download_for_node(state: State, store: RemoteStore | None, manifest: Manifest, scratch: Path) -> str | None:
    """Collective: steps 1-3 of the module docstring. Returns why the checkpoint is corrupt (a file that
    failed verification on some node), or None when every node holds what its ranks read."""
    started, downloaded = time.monotonic(), [0, 0]  # bytes, files

    def fetch(paths: set[str]) -> None:
        if distributed.node_leader():
            assert store is not None, "a node leader of a multi-node sharded run holds the remote"
            downloaded[0] += store.pull_files(manifest, paths, scratch)
            downloaded[1] += len(paths)

    if distributed.node_leader():
        shutil.rmtree(scratch, ignore_errors=True)  # a resume that died half-way
    whole = not manifest.meta.get("sharded")
    failure = _agree_on(lambda: fetch(_all_files(manifest) if whole else {DCP_METADATA}))
    if failure is not None or whole:
        return _logged(failure, manifest, started, downloaded)
    needs = distributed.all_gather((distributed.node(), *_files_read(state, scratch, manifest)))
    errors = [e for _, _, e in needs if e is not None]
    if errors:  # the metadata verified but does not fit (or is hostile): the same refusal as on one node
        raise CheckpointLoadError(errors[0])
    mine = {f for node, files, _ in needs if node == distributed.node() for f in files} | _per_rank_files(manifest)
    failure = _agree_on(lambda: fetch(mine))
    return _logged(failure, manifest, started, downloaded)


def _files_read(state: State, scratch: Path, manifest: Manifest) -> tuple[set[str], str | None]:
    from job import dcp_storage, sharded  # DCP only where a sharded checkpoint is read (job.sharded_layout)
    try:
        return sharded.files_read(state, scratch, dcp_storage.read_metadata(scratch, manifest)), None
    except CheckpointLoadError as e:
        return set(), str(e)


def _agree_on(step: Any) -> str | None:
    """Run ``step`` (a download on node leaders) on every rank; a file that failed verification anywhere
    is the returned reason on every rank, any other failure an error raised on every rank."""
    corrupt: str | None = None
    error: BaseException | None = None
    try:
        step()
    except (CorruptCheckpoint, ManifestError) as e:
        corrupt = f"node {distributed.node()}: {e}"
    except Exception as e:  # noqa: BLE001 - raised below, after every rank has heard of it
        error = e
    failure = (f"{type(error).__name__}: {error}", exit_code_for(error)) if error is not None else None
    outcomes = distributed.gather_leavable((corrupt, failure), "download their parts of the checkpoint", error)
    if error is not None:
        raise error
    failed = [f for _, f in outcomes if f is not None]
    if failed:  # with the failing node's exit code: its full disk (7) or outage (5) is not a bad checkpoint (6)
        message, code = failed[0]
        raise OtherRankError(f"another node could not download its part of the checkpoint ({message})", code)
    return next((c for c, _ in outcomes if c is not None), None)


def _logged(failure: str | None, manifest: Manifest, started: float, downloaded: list[int]) -> str | None:
    if failure is not None:
        logger.warning("step %d failed verification (%s); trying the checkpoint before it", manifest.step, failure)
    elif distributed.node_leader():
        event(logger, "pulled", step=manifest.step, node=distributed.node(), nodes=distributed.nodes(),
              files=downloaded[1], bytes=downloaded[0], of_bytes=manifest.total_size,
              seconds=round(time.monotonic() - started, 3))
    return failure


def _per_rank_files(manifest: Manifest) -> set[str]:
    """What every rank of a sharded resume reads besides its shards: the replicated state and every
    rank's own state (small; job.elastic hands them over on any number of ranks)."""
    return {f.path for f in manifest.files if f.path == REPLICATED_FILE or RANK_FILE_RE.fullmatch(f.path)}


def _all_files(manifest: Manifest) -> set[str]:
    return {f.path for f in manifest.files}
