"""TensorBoard curves read back the way TensorBoard reads them (its own EventAccumulator)."""
from __future__ import annotations

import time
from pathlib import Path


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in ``logdir``'s event files: (step, value) in the order TensorBoard shows them.

    All the files of the folder are read in name order, with TensorBoard's default purge of orphaned
    data (a SessionLog START at step S hides what earlier files logged at S or later), and no sampling
    (``size_guidance`` 0 keeps every point)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def steps(scalars: dict[str, list[tuple[int, float]]], tag: str) -> list[int]:
    return [step for step, _ in scalars.get(tag, [])]


def next_second() -> None:
    """Wait for the wall clock's next second. An event file's name starts with its creation time in
    seconds, and TensorBoard reads a folder's files in name order: two lives of a real job start seconds
    apart, two lives run back to back in one test may not."""
    now = time.time()
    time.sleep(int(now) + 1 - now + 0.01)
