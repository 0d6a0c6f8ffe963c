"""Training curves as TensorBoard event files that survive preemption.

The scalars come from the job's own events (job.logs.listening), so the curves and the log never
disagree and no training code knows about TensorBoard. They are written under the save folder
(:data:`TENSORBOARD_DIR`) and go up to the remote with the run log, so ``tensorboard --logdir`` on the
folder or on the bucket shows the whole run.

A life of the job usually logs past its last checkpoint before it is preempted; the next life resumes
from that checkpoint and logs those steps again. Every life therefore opens its writer with
``purge_step=start_step + 1``: its event file starts with a SessionLog START at that step, and
TensorBoard's reader, reading the files in name order (the name starts with the creation time in
seconds), drops every scalar an earlier file logged at that step or later. The curve is then each step
exactly once, from the life that went on to the end, however many lives there were and whichever disk
wrote each file. Steps up to ``start_step`` stay as the earlier life wrote them: they are the resumed
checkpoint's past, and this life logs nothing at ``start_step`` itself.

Curves are a record, not state: a failure to write them (a full disk) is logged once and ends the
curves, never the training.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from job.logs import listening
from uploader.runlog import RUNLOG_DIR

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = Path(RUNLOG_DIR) / "tensorboard"  # relative to the save folder (uploader.runlog)


class _Curves:
    """The listener: events in, scalars out. Called from the training thread and the checkpoint writer
    threads; ``_lock`` keeps the ``_failed`` switch and a flush from racing a close."""

    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self._lock = threading.Lock()
        self._failed = False

    def __call__(self, name: str, fields: dict[str, Any]) -> None:
        scalars = _scalars(name, fields)
        if not scalars:
            return
        with self._lock:
            if self._failed:
                return
            try:
                for tag, value in scalars:
                    self._writer.add_scalar(tag, value, global_step=int(fields["step"]))
                if name == "checkpoint":  # an upload that follows this commit carries the curves up to it
                    self._writer.flush()
            except Exception as e:  # noqa: BLE001 - a listener must never raise into training
                self._failed = True
                logger.warning("training curves stop here (TensorBoard files in %s): %s",
                               self._writer.log_dir, e)

    def close(self) -> None:
        with self._lock:
            try:
                self._writer.close()  # flushes
            except Exception as e:  # noqa: BLE001 - the job's outcome does not depend on its curves
                if not self._failed:
                    logger.warning("training curves not all written (TensorBoard files in %s): %s",
                                   self._writer.log_dir, e)
            self._failed = True


def _scalars(name: str, fields: dict[str, Any]) -> list[tuple[str, float]]:
    """The scalars one event carries; fields that are missing or None are skipped."""
    if "step" not in fields:
        return []
    if name == "progress":
        pairs = [("train/loss", fields.get("loss")), ("train/lr", fields.get("lr")),
                 ("perf/samples_per_sec", fields.get("samples_per_sec"))]
    elif name == "eval":
        pairs = [(f"eval/{label}/{metric}", value)
                 for label, metrics in (fields.get("metrics") or {}).items() for metric, value in metrics.items()]
    elif name == "checkpoint":
        pairs = [("checkpoint/stall_seconds", fields.get("stall")), ("checkpoint/write_seconds", fields.get("seconds"))]
    else:
        return []
    return [(tag, float(value)) for tag, value in pairs if value is not None]


@contextlib.contextmanager
def recording(folder: Path, start_step: int) -> Iterator[None]:
    """Write the training curves of this life to ``folder / TENSORBOARD_DIR`` while inside.

    ``start_step``: the step training starts from (0 fresh, N when resumed from step N); whatever an
    earlier life logged after it is hidden from TensorBoard (module docstring). Rank 0 only. The
    ``tensorboard`` package is imported here, so a ``--no-tensorboard`` run never imports it. A folder
    that cannot be written to is logged and the run goes on without curves.
    """
    from torch.utils.tensorboard import SummaryWriter  # heavy (protobuf); only when curves are wanted

    log_dir = folder / TENSORBOARD_DIR
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1)
    except OSError as e:
        logger.warning("no training curves: cannot write TensorBoard files to %s: %s", log_dir, e)
        yield
        return
    curves = _Curves(writer)
    try:
        with listening(curves):
            yield
    finally:
        curves.close()
