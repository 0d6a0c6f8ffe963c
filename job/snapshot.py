"""Host-memory snapshots of a state dict, into buffers reused from one checkpoint to the next.

The training loop blocks only while tensors are copied into these buffers; serialization, hashing,
fsync and upload then run in the background from the copy. Reusing the buffers bounds host memory
at about one extra copy of the state. On CUDA the buffers are pinned and the copies asynchronous:
the copy overlaps the next step's kernels (same stream, so it still reads the weights before the
next optimizer step changes them), and the writer waits on a CUDA event before reading.

Pipelined (:meth:`HostSnapshot.capture_pipelined`, CheckFreq's pipelining): the large tensors that
only the optimizer step writes are copied while the next step runs its forward and backward, and
the loop waits for that copy (:meth:`Deferred.block_writes`) only right before its optimizer step.
The rule (:func:`written_by_update`), on ``State.state_dict()``'s layout:

* copied later: ``model[name]`` when its storage is a parameter of one of the optimizers (by
  ``data_ptr``: tied and DDP-prefixed names alike), and every tensor of
  ``optimizers[type]["state"][index][key]`` (the per-parameter moments, momentum buffers and
  step counts);
* copied now, as before: everything else: the model's buffers (BatchNorm's running statistics
  change in forward), ``param_groups`` (a scheduler writes the lr), scheduler, scaler, timer, RNG,
  train metrics (updated in forward), ``per_rank``. They are small.

This holds while nothing but the optimizer step writes parameters or optimizer state between two
steps (zero_grad, forward, backward, DDP's all-reduce and evaluation do not, as a rule); anything else
that does must call ``block_writes`` first. Some stock modules break the rule: ``nn.Embedding(max_norm=...)``
renormalizes the rows it looks up, in place, in every forward. So the rule is checked, not trusted: every
in-place write bumps a tensor's version counter, and :meth:`Deferred.settle`, in the training thread
right before the optimizer step, compares each deferred tensor's version with the one it had at the
capture. A tensor written since may have been copied after the write: the snapshot is stale, and its
writer discards it instead of committing it (Deferred.wait_settled); the caller copies such tensors at
once from then on (job.checkpoint). On CUDA the copies are issued at once on a side stream that first
waits for the current one, and ``block_writes`` makes the current stream wait for the side stream's
event: the host does not block. On CPU the writer's thread copies, one piece (up to 16 MiB of a tensor)
at a time, at the writer's priority and alone (one memmove, no OpenMP team of its own): it takes the CPU
training leaves idle, not cores from training's own threads. If the loop reaches ``block_writes`` first,
it copies the pieces not yet started itself, with all of its threads, and waits only for the one in
progress. (BENCHMARKS.md, eleventh session: two training threads on two cores, a copy at training's
priority on a team of its own cost the steps around a checkpoint +236 ms at 600 MB and +381 ms at 1 GB;
this way, +52 and +144.)
"""
from __future__ import annotations

import copy
import ctypes
import threading
from typing import Any, Callable, Iterable

import torch

Path_ = tuple[Any, ...]
TensorSpec = tuple[Path_, torch.Size, torch.dtype, bool]  # path in the tree, shape, dtype, pinned
_SCALARS = (int, float, bool, str, bytes, type(None))
Later = Callable[[Path_, torch.Tensor], bool]  # which tensors capture_pipelined leaves for later
Pair = tuple[torch.Tensor, torch.Tensor]  # (buffer, source) of one deferred copy
# On the CPU a deferred tensor is copied in pieces of at most this many bytes: what the loop waits for
# when it takes over (a whole 64 MB tensor of the 1 GB benchmark model took ~10 ms on one core).
PIECE_BYTES = 16 << 20


def written_by_update(optimizers: Iterable[torch.optim.Optimizer]) -> Later:
    """The module docstring's rule: a tensor only ``optimizers``' step writes, given its path in the tree."""
    params = {p.data_ptr() for opt in optimizers for group in opt.param_groups for p in group["params"]}

    def later(path: Path_, tensor: torch.Tensor) -> bool:
        if len(path) == 2 and path[0] == "model":
            return tensor.data_ptr() in params
        return len(path) == 5 and path[0] == "optimizers" and path[2] == "state"

    return later


def copy_into(buf: torch.Tensor, src: torch.Tensor, alone: bool = False) -> None:
    """One deferred copy (the tests hold it to show what runs meanwhile).

    ``alone``: from a thread other than training's, on the CPU. torch's copy would run on an OpenMP team
    of this thread's own, as large as training's; where training's threads already fill the cores, the
    extra ones take cores from training's team, which then waits at each barrier for the thread they
    displaced. A memmove in this thread copies the same bytes."""
    if alone and _same_bytes(buf, src):
        ctypes.memmove(buf.data_ptr(), src.data_ptr(), buf.numel() * buf.element_size())  # releases the GIL
    else:
        buf.copy_(src, non_blocking=buf.is_pinned())


def _pieces(buf: torch.Tensor, src: torch.Tensor) -> list[Pair]:
    """``(buf, src)`` as copies of at most PIECE_BYTES each, where a byte copy is right (flat views of
    contiguous memory); a tensor that needs torch's copy stays whole."""
    step = max(1, PIECE_BYTES // buf.element_size())
    if buf.numel() <= step or not _same_bytes(buf, src):
        return [(buf, src)]
    flat_buf, flat_src = buf.view(-1), src.view(-1)
    return [(flat_buf[i:i + step], flat_src[i:i + step]) for i in range(0, flat_buf.numel(), step)]


def _same_bytes(buf: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether copying the bytes gives what ``buf.copy_(src)`` gives: both dense in host memory, the same
    dtype and shape, and no lazy conjugation or negation on ``src``."""
    return (buf.device.type == "cpu" and src.device.type == "cpu" and buf.dtype == src.dtype
            and buf.shape == src.shape and src.layout == torch.strided and not src.is_quantized
            and buf.is_contiguous() and src.is_contiguous() and not src.is_conj() and not src.is_neg())


class Deferred:
    """The copies :meth:`HostSnapshot.capture_pipelined` left for later: the writer's thread ``run``s
    them; the training thread, in ``block_writes``, takes over the ones not yet started, and ``settle``s
    whether the sources stayed as they were captured (module docstring)."""

    def __init__(self, pairs: list[Pair], event: torch.cuda.Event | None,
                 versions: list[tuple[Path_, torch.Tensor, int]] | None = None) -> None:
        self._pairs = pairs  # (buffer, source); on CUDA held until the side stream is done with the sources
        self._event = event  # CUDA: recorded on the side stream after its copies
        self._versions = versions or []  # (path, source, its version counter at the capture)
        self._written: list[Path_] = []  # the sources written between the capture and settle
        self._settled = threading.Event()
        self._lock = threading.Lock()
        self._taken = 0  # pairs[:taken] are copied or being copied, by one thread or the other
        self._left = len(pairs)  # pairs not copied yet
        self._failed = False
        self.done = threading.Event()  # every copy is over (or one failed)
        if not pairs:
            self.done.set()

    def run(self) -> bool:
        """In the writer's thread: the copies (CUDA: wait for the side stream's). False when one failed in
        the training thread, which raised it there: the snapshot is incomplete and must not be written."""
        if self._event is not None:
            try:
                self._event.synchronize()
            finally:
                self._pairs = []
                self.done.set()
            return True
        self._copy_until_none_left(alone=True)
        self.done.wait()  # for the ones the training thread took
        return not self._failed

    def settle(self) -> list[Path_]:
        """In the training thread, where nothing writes the sources before the copies are over: right before the
        optimizer step, its copies done; or in a wait that joins the writer. The deferred tensors written in
        place since the capture (their copy may hold the write); empty: the snapshot is the state at the
        capture, and its writer may commit it."""
        if not self._settled.is_set():
            self._written = [path for path, src, version in self._versions if src._version != version]
            self._versions = []  # the sources are not held past this step
            self._settled.set()
        return self._written

    def found_stale(self) -> bool:
        """Settled already, and stale: the writer need not write it at all."""
        return self._settled.is_set() and bool(self._written)

    def wait_settled(self) -> bool:
        """In the writer's thread, before its commit: True once the training thread has found the sources
        unwritten since the capture; False where one was written (the snapshot must be discarded)."""
        self._settled.wait()
        return not self._written

    def block_writes(self) -> None:
        """In the training thread, before anything writes the sources: copy the pieces no thread has
        started, then block until the rest are done (CUDA: the current stream waits, the host does not)."""
        if self.done.is_set():
            return
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            return
        self._copy_until_none_left(alone=False)
        self.done.wait()

    def _copy_until_none_left(self, alone: bool) -> None:
        try:
            while (pair := self._take()) is not None:
                copy_into(*pair, alone=alone)
                self._copied()
        except BaseException:
            with self._lock:
                self._failed = True
                self.done.set()
            raise

    def _take(self) -> Pair | None:
        with self._lock:
            if self._failed or self._taken == len(self._pairs):
                return None
            self._taken += 1
            return self._pairs[self._taken - 1]

    def _copied(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self.done.set()


class HostSnapshot:
    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self._buffers: dict[Path_, torch.Tensor] = {}
        self.bytes = 0

    def reserve(self, specs: list[TensorSpec]) -> None:
        """Allocate and touch the buffers ahead of the first capture (from a background thread).

        Otherwise the first checkpoint pays for fresh host memory (or pinning) inside the training
        loop: 1.7 s for 1 GB on the benchmark VM, 27 times the stall of the ones after it.
        """
        for path, shape, dtype, pinned in specs:
            buf = self._buffers.get(path)
            if buf is None or buf.shape != shape or buf.dtype != dtype:
                buf = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)
                buf.zero_()  # touch every page now
                self._buffers[path] = buf

    def specs(self, tree: Any) -> list[TensorSpec]:
        """What :meth:`reserve` needs to know of ``tree``'s tensors (read in the training thread)."""
        found: list[TensorSpec] = []

        def walk(node: Any, path: Path_) -> None:
            if isinstance(node, torch.Tensor):
                found.append((path, node.shape, node.dtype, self.pin_memory and node.device.type == "cuda"))
            elif isinstance(node, dict):
                for k, v in node.items():
                    walk(v, (*path, k))
            elif isinstance(node, (list, tuple)):
                for i, v in enumerate(node):
                    walk(v, (*path, i))

        walk(tree, ())
        return found

    def capture(self, tree: Any) -> tuple[Any, torch.cuda.Event | None]:
        """Copy every tensor of ``tree`` into this snapshot's buffers; returns the copied tree.

        The returned tree shares the buffers: it stays valid until the next ``capture``. The event,
        when not None, must be synchronized before the copy is read (asynchronous device copies).
        """
        copied, event, _ = self.capture_pipelined(tree, lambda path, tensor: False)
        return copied, event

    def capture_pipelined(self, tree: Any, later: Later) -> tuple[Any, torch.cuda.Event | None, Deferred]:
        """:meth:`capture`, except for the tensors ``later`` selects: their buffers are in the returned
        tree, filled by the returned :class:`Deferred` (module docstring)."""
        self.bytes = 0
        seen: set[Path_] = set()
        later_ones: list[tuple[Path_, torch.Tensor, torch.Tensor]] = []  # (path, buffer, source)
        copied = self._copy(tree, (), seen, later, later_ones)
        deferred = [(buf, src) for _, buf, src in later_ones]
        versions = [(path, src, src._version) for path, _, src in later_ones]
        for stale in set(self._buffers) - seen:  # the state shrank: free what it no longer uses
            del self._buffers[stale]
        event = side_done = None
        if self.pin_memory:
            event = torch.cuda.Event()
            event.record()
            if deferred:  # a side stream copies them while the current one runs the next forward and backward
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for buf, src in deferred:
                        if src.is_cuda:
                            src.record_stream(side)
                        copy_into(buf, src)
                side_done = side.record_event()
        else:
            deferred = [piece for pair in deferred for piece in _pieces(*pair)]
        return copied, event, Deferred(deferred, side_done, versions)

    def _copy(self, node: Any, path: Path_, seen: set[Path_], later: Later,
              deferred: list[tuple[Path_, torch.Tensor, torch.Tensor]]) -> Any:
        if isinstance(node, torch.Tensor):
            seen.add(path)
            src = node.detach()
            buf = self._buffer(src, path)
            if later(path, src):
                deferred.append((path, buf, src))
            else:
                buf.copy_(src, non_blocking=buf.is_pinned())
            return buf
        if isinstance(node, dict):
            return type(node)((k, self._copy(v, (*path, k), seen, later, deferred)) for k, v in node.items())
        if isinstance(node, (list, tuple)) and all(isinstance(v, _SCALARS) for v in node):
            # Immutable leaves (the python RNG state is 625 ints): a shallow copy is a full copy.
            return list(node) if isinstance(node, list) else node
        if isinstance(node, list):
            return [self._copy(v, (*path, i), seen, later, deferred) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return tuple(self._copy(v, (*path, i), seen, later, deferred) for i, v in enumerate(node))
        return copy.deepcopy(node)

    def _buffer(self, src: torch.Tensor, path: Path_) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu",
                              pin_memory=self.pin_memory and src.device.type == "cuda")
            self._buffers[path] = buf
        self.bytes += buf.numel() * buf.element_size()
        return buf
