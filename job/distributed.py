"""Running under torchrun: one process per device, DDP, and every decision taken by all ranks together.

Ranks must agree on each checkpoint and on stopping, or one would wait forever in a collective the
others never enter: SIGTERM and wall-clock intervals reach ranks at different moments, so after each
step the ranks all-reduce their flags (one tiny collective). Rank 0 writes the replicated state
(model, optimizer, timer); what differs per rank (RNG streams, metric accumulators) is gathered into
the same checkpoint and handed back to each rank on resume. Rank 0 alone chooses the checkpoint to
resume from (local or remote) and broadcasts it, so all ranks load the same one.
"""
from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from job import leavable
from job.exceptions import OtherRankError, exit_code_for
from job.safe_load import first_line

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Each rank's own state in a checkpoint: its RNG streams, its train-metric accumulators, and (sharded runs
# on several ranks only, job.sharded_layout.own_buffers) its model buffers; absent entries are None.
PER_RANK_KEYS = ("rng", "train_metrics", "buffers")
PER_RANK = "per_rank"

COLLECTIVE_TIMEOUT_S = 600.0

_joined = False  # set once this process joins a process group; stays set after shutdown()
_kept: list[object] = []  # what holds a process group, never freed before os._exit (keep_until_exit)
_node = (0, 1)  # (this node's rank, number of nodes): nodes have their own disks (job.checkpoint)


@dataclass(frozen=True)
class DistConfig:
    """What torchrun tells a worker (read from its environment at the CLI edge)."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    master_addr: str = ""
    master_port: int = 0
    attempt: int = 0  # torchrun's restart count: each restarted group gets a fresh store namespace
    agent_store: bool = False  # the launcher hosts the store (TORCHELASTIC_USE_AGENT_STORE)
    node_rank: int = 0  # torchrun's GROUP_RANK: which node (launcher) this process runs on
    local_world_size: int = 1  # processes per node (LOCAL_WORLD_SIZE)
    # How long a collective waits for the slowest rank before the run fails: a hang's limit, and longer than
    # the uploading ranks' wait for the final upload (--final-upload-timeout), which the others spend in one.
    timeout_s: float = COLLECTIVE_TIMEOUT_S

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or self.local_rank < 0:
            raise ValueError(f"inconsistent torchrun environment: rank {self.rank}, world size {self.world_size}")
        if self.enabled and not (self.master_addr and 0 < self.master_port < 65536):
            raise ValueError(f"WORLD_SIZE is {self.world_size} but MASTER_ADDR and MASTER_PORT do not name the "
                             "rendezvous: start the job with torchrun (it sets them), or unset WORLD_SIZE for one "
                             "process")


def init(cfg: DistConfig, device: str) -> None:
    """Join the process group (env:// rendezvous set up by torchrun): NCCL on GPUs, gloo on CPU."""
    global _joined, _node
    if not cfg.enabled or dist.is_initialized():
        return
    _node = (cfg.node_rank, cfg.nodes)
    _joined = True
    if device == "cuda":
        torch.cuda.set_device(cfg.local_rank)
    backend, timeout = ("nccl" if device == "cuda" else "gloo"), datetime.timedelta(seconds=cfg.timeout_s)
    # Seen with torch 2.13: after an elastic restart, gloo read the previous group's peer addresses from
    # the launcher's store (connection refused, every round). A namespace per restart keeps them apart.
    store = dist.PrefixStore(f"/spot-trainer/attempt_{cfg.attempt}", dist.TCPStore(
        cfg.master_addr, cfg.master_port, cfg.world_size, is_master=not cfg.agent_store and cfg.rank == 0,
        timeout=timeout))
    dist.init_process_group(backend, store=store, rank=cfg.rank, world_size=cfg.world_size, timeout=timeout)
    leavable.use(store, cfg.rank, cfg.world_size, cfg.timeout_s)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def joined() -> bool:
    """True in a process that has joined a process group, even after :func:`shutdown`.

    Such a process must leave with ``os._exit`` (job.cli.main): with torch 2.13 the gloo group lives on
    in DDP's Reducer after destroy_process_group, and its destructor, run when the model is freed at
    interpreter exit, joins gloo's worker threads while holding the GIL. A worker thread still
    dropping a finished collective's tensors needs the GIL: both wait forever (seen in CI, about one
    torchrun run in eight: main thread in ~ProcessGroupGloo from ~Reducer, a pt_gloo_runloop thread
    in take_gil inside ~AsyncBarrierWork).
    """
    return _joined


def keep_until_exit(holder: object) -> None:
    """Never free ``holder`` (DDP's model, a device mesh): the process leaves with ``os._exit``.

    os._exit alone (joined) is not enough: when the function that built the model returns, its frame
    frees the model, and DDP's Reducer takes the last reference to the gloo group with it, in the
    deadlock :func:`joined` describes, before os._exit is reached (seen again in CI: the main thread
    in ~ProcessGroupGloo from ~Reducer from a frame being cleared, after the "finished" event).
    """
    _kept.append(holder)


def active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def node_leader() -> bool:
    """True for one process per node (local rank 0): the one that speaks for the node's local folder."""
    if not dist.is_initialized():
        return True
    return dist.get_node_local_rank(fallback_rank=0) == 0


def node() -> int:
    """This process's node (torchrun's GROUP_RANK); 0 outside torchrun."""
    return _node[0]


def nodes() -> int:
    """How many nodes the job runs on: each has its own --save-folder, and writes its part of a sharded
    checkpoint there (job.checkpoint, uploader.sync "Multi-node")."""
    return _node[1] if dist.is_initialized() else 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def agree(*flags: bool) -> tuple[bool, ...]:
    """Each flag true on any rank becomes true on all ranks."""
    if not active():
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(v) for v in t.tolist())


def total(count: int) -> int:
    """The sum of ``count`` over all ranks: what one rank counted of a step (its tokens) made the job's."""
    if not active():
        return count
    t = torch.tensor([count], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def barrier() -> None:
    if active():
        dist.barrier()


def gather_per_rank(tree: dict[str, Any]) -> dict[str, Any]:
    """Add every rank's RNG and metric state to rank 0's state dict (collective: all ranks call it)."""
    if not active():
        return tree
    return {**tree, PER_RANK: all_gather({k: tree.get(k) for k in PER_RANK_KEYS})}


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not active():
        return [obj]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def gather_leavable(obj: Any, what: str, own: BaseException | None = None) -> list[Any]:
    """:func:`all_gather` after work that may take one rank minutes: before training, a rank stopped
    while it waits for that one leaves the wait, and so do the others (job.leavable). ``own``: this rank's
    failure, logged where the wait ends for another rank's reason instead."""
    _arrive(what, own)
    return all_gather(obj)


def _arrive(what: str, own: BaseException | None) -> None:
    try:
        leavable.arrive(what)
    except Exception:
        if own is not None:
            logger.warning("could not %s (%s); the ranks end for another rank's reason instead", what,
                           first_line(own, 300))
        raise


def broadcast_choice(obj: Any) -> Any:
    """Rank 0's value on every rank (the resume decision, or the loaded checkpoint itself)."""
    if not active():
        return obj
    box = [obj if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def decided_by_first(decide: Callable[[], T], what: str) -> T:
    """``decide()`` on rank 0, its result on every rank. Where it fails, rank 0 raises its error and
    every other rank an OtherRankError with rank 0's exit code: none is left to find out from a closed
    connection at its next collective, which reads as a bug (exit 1, a traceback)."""
    value: T | None = None
    failed: Exception | None = None
    if rank() == 0:
        try:
            value = decide()
        except Exception as e:  # noqa: BLE001 - raised below, once every rank has heard of it
            failed = e
    _arrive(what, failed)  # before training, a rank stopped while rank 0 decides leaves here (job.leavable)
    value, why = broadcast_choice((value, _why(failed)))
    if failed is not None:
        raise failed
    if why is not None:
        raise OtherRankError(f"rank 0 could not {what} ({why[0]})", why[1])
    return value  # type: ignore[return-value]  # T, which may itself be None


def raise_together(error: BaseException | None, what: str) -> None:
    """Collective: this rank's failure (or None) raised here, and on every rank without one the first
    failing rank's, as an OtherRankError with its exit code. For work one rank does alone (rank 0 writes
    the replicated checkpoint), whose failure the others would otherwise meet as a closed connection at
    their next collective (exit 1, a traceback) instead of the documented exit code."""
    whys = gather_leavable(_why(error), what, error)
    if error is not None:
        raise error
    for failed_rank, why in enumerate(whys):
        if why is not None:
            raise OtherRankError(f"rank {failed_rank} could not {what} ({why[0]})", why[1])


def run_together(work: Callable[[], T] | None, what: str) -> T | None:
    """Collective: ``work()`` on the ranks given one (None: nothing to do here), and its result; a failure
    on any rank is raised on every rank, as :func:`raise_together` does."""
    value: T | None = None
    error: Exception | None = None
    if work is not None:
        try:
            value = work()
        except Exception as e:  # noqa: BLE001 - raised below, once every rank has heard of it
            error = e
    raise_together(error, what)
    return value


def _why(error: BaseException | None) -> tuple[str, int] | None:
    """A failure as the other ranks are told it: its first line (the whole of it is on the failing
    rank's stderr) and its exit code."""
    return None if error is None else (f"{type(error).__name__}: {first_line(error, 300)}", exit_code_for(error))


def broadcast_tensors(tensors: list[torch.Tensor]) -> None:
    """Rank 0's values into ``tensors`` on every rank, in place (each tensor once, tied ones too): what
    DistributedDataParallel does to the model's parameters and buffers when it wraps it."""
    if not active():
        return
    seen: set[int] = set()
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            dist.broadcast(tensor.detach(), src=0)


def gather_to_first(obj: Any) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank 0; None on the others."""
    if not active():
        return [obj]
    everyone: list[Any] | None = [None] * dist.get_world_size() if rank() == 0 else None
    dist.gather_object(obj, everyone, dst=0)
    return everyone


def scatter_from_first(objs: list[Any] | None) -> Any:
    """Rank 0 hands ``objs[r]`` to rank r (``objs`` is read on rank 0 only)."""
    if not active():
        assert objs is not None
        return objs[0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, objs if rank() == 0 else None, src=0)
    return box[0]
