"""Loading torch files from a disk or a bucket: ``torch.load(weights_only=True)``, errors as corrupt checkpoints.

Every file of a checkpoint is untrusted input. torch's weights-only unpickler allows tensors and plain
containers only and refuses anything that would run code; whatever it refuses, and whatever is not a
torch file at all, becomes a CheckpointLoadError (exit 6) that names the file, never a crash. Shared by
whole files (job.checkpoint) and the byte ranges of sharded checkpoints (job.dcp_storage).
"""
from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import IO, Any

import torch

from job.exceptions import CheckpointLoadError


def load_weights_only(source: Path | IO[bytes], what: str, mmap: bool = False) -> Any:
    """``source`` (a path, or an open binary file) loaded to CPU with weights_only=True; ``what`` names
    it in the error. ``mmap`` maps a file's tensors instead of reading them (paths only)."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointLoadError(
            f"refusing to load {what}: it needs pickled code, which is never executed ({unpickler_reason(e)}); "
            "only checkpoints written by spot-trainer can be resumed"
        ) from None
    except FileNotFoundError:
        raise CheckpointLoadError(f"{what} is missing") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise CheckpointLoadError(f"{what} is not a readable torch file ({first_line(e)})") from None


def unpickler_reason(e: pickle.UnpicklingError) -> str:
    """The one sentence of torch's refusal that names what the file wanted (``Unsupported global:
    GLOBAL getattr ...``). The rest advises loading it without the weights-only guard, which this job never does."""
    found = re.search(r"WeightsUnpickler error: (.+?)(?:\.\s|\.?$)", str(e), re.MULTILINE)
    return clip(found.group(1) if found else (str(e).strip().splitlines() or [type(e).__name__])[0], 160)


def first_line(e: BaseException, limit: int = 160) -> str:
    """An exception as one short line (torch's messages run over many)."""
    lines = str(e).strip().splitlines()
    return clip(lines[0] if lines else type(e).__name__, limit)


def clip(text: str, limit: int) -> str:
    """``text`` on one line (a tensor's repr has several) and cut to ``limit`` characters, with "..." when
    cut: error lines stay one readable line."""
    text = re.sub(r"\s*\n\s*", " ", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
