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
steps (zero_grad, forward, backward, DDP's all-reduce and evaluation do not); anything else that does
must call ``block_writes`` first. On CPU a thread copies (torch's copy releases the GIL); on CUDA the
copies are issued at once on a side stream that first waits for the current one, and ``block_writes``
makes the current stream wait for the side stream's event: the host does not block.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Iterable

import torch

Path_ = tuple[Any, ...]
TensorSpec = tuple[Path_, torch.Size, torch.dtype, bool]  # path in the tree, shape, dtype, pinned
_SCALARS = (int, float, bool, str, bytes, type(None))
Later = Callable[[Path_, torch.Tensor], bool]  # which tensors capture_pipelined leaves for later


def written_by_update(optimizers: Iterable[torch.optim.Optimizer]) -> Later:
    """The module docstring's rule: a tensor only ``optimizers``' step writes, given its path in the tree."""
    params = {p.data_ptr() for opt in optimizers for group in opt.param_groups for p in group["params"]}

    def later(path: Path_, tensor: torch.Tensor) -> bool:
        if len(path) == 2 and path[0] == "model":
            return tensor.data_ptr() in params
        return len(path) == 5 and path[0] == "optimizers" and path[2] == "state"

    return later


def copy_into(buf: torch.Tensor, src: torch.Tensor) -> None:
    """One deferred copy (the tests hold it to show what runs meanwhile)."""
    buf.copy_(src, non_blocking=buf.is_pinned())


class Deferred:
    """The copies :meth:`HostSnapshot.capture_pipelined` left for later; ``run`` them in a thread."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], event: torch.cuda.Event | None) -> None:
        self._pairs = pairs  # (buffer, source); on CUDA held until the side stream is done with the sources
        self._event = event  # CUDA: recorded on the side stream after its copies
        self.done = threading.Event()
        if not pairs:
            self.done.set()

    def run(self) -> None:
        """In a background thread: the copies (CUDA: wait for the side stream's); ``done`` when they are over."""
        try:
            if self._event is not None:
                self._event.synchronize()
            else:
                for buf, src in self._pairs:
                    copy_into(buf, src)
        finally:
            self._pairs = []
            self.done.set()

    def block_writes(self) -> None:
        """In the training thread, before anything writes the sources: block until the copies are done
        (CUDA: the current stream waits for them, the host does not)."""
        if self.done.is_set():
            return
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        else:
            self.done.wait()


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
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        copied = self._copy(tree, (), seen, later, deferred)
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
        return copied, event, Deferred(deferred, side_done)

    def _copy(self, node: Any, path: Path_, seen: set[Path_], later: Later,
              deferred: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if isinstance(node, torch.Tensor):
            seen.add(path)
            src = node.detach()
            buf = self._buffer(src, path)
            if later(path, src):
                deferred.append((buf, src))
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
