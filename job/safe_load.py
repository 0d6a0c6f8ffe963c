"""Loading torch files from a disk or a bucket: ``torch.load(weights_only=True)``, errors as corrupt checkpoints.

Every file of a checkpoint is untrusted input. torch's weights-only unpickler allows tensors and plain
containers only and refuses anything that would run code; whatever it refuses, and whatever is not a
torch file at all, becomes a CheckpointLoadError (exit 6) that names the file, never a crash. Shared by
whole files (job.checkpoint) and the byte ranges of sharded checkpoints (job.dcp_storage).

What a load allocates is bounded by the bytes it reads. torch's zip reader also inflates DEFLATE
records, so a few hundred KB could hold a tensor of gigabytes (found only after it is in memory);
torch.save never compresses, and a load that does not map the file (mmap=False, the byte ranges of
sharded checkpoints) first refuses any record that is not stored as is (:func:`check_stored`). A mapped
load refuses compressed records itself.
"""
from __future__ import annotations

import io
import itertools
import pickle
import re
import sys
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from job.exceptions import ADVICE, CheckpointLoadError
from state.display import clip


def load_weights_only(source: Path | IO[bytes], what: str, mmap: bool = False) -> Any:
    """``source`` (a path, or an open binary file) loaded to CPU with weights_only=True; ``what`` names
    it in the error. ``mmap`` maps a file's tensors instead of reading them (paths only)."""
    if not mmap:
        check_stored(source, what)
    try:
        loaded = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointLoadError(
            f"refusing to load {what}: it needs pickled code, which is never executed ({unpickler_reason(e)}); "
            "only checkpoints written by spot-trainer can be resumed"
        ) from None
    except FileNotFoundError:
        raise CheckpointLoadError(f"{what} is missing") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise CheckpointLoadError(f"{what} is not a readable torch file ({first_line(e)})") from None
    check_unfolded(loaded, what)
    return loaded


# What a loaded tree may hold, counting each container and value once per place it appears: far above any
# real state (a model's and its optimizer's tensors, a few entries each), and a bound on what any walk over
# it costs. A pickle stores a shared object once: 1.4 KB held a list shared 40 levels deep, 2**40 places,
# and torch's Optimizer.load_state_dict, the RNG restore and every repr walk it per place (hung, 24 GB).
MAX_PLACES = 10_000_000


def check_unfolded(tree: Any, what: str) -> None:
    """A CheckpointLoadError unless ``tree`` (as torch.load returned it) has at most MAX_PLACES places once
    its sharing is unfolded, and no container that holds itself (which every walk follows forever). Linear
    in the distinct objects: each container's count is kept once found."""
    counted: dict[int, int] = {}
    open_now: set[int] = set()

    def places(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            _check_tensor(value, what)
        if not isinstance(value, (dict, list, tuple, set, frozenset)):
            return 1
        key = id(value)
        if key in counted:
            return counted[key]
        if key in open_now:
            raise CheckpointLoadError(f"{what} is damaged or hostile: a container in it holds itself; {ADVICE}")
        open_now.add(key)
        total = 1
        # A dict's keys and values, never its items: each items() pair is a new tuple, and an id is only
        # worth keeping for objects the tree keeps alive (a freed pair's id comes back for the next one).
        for item in (itertools.chain(value.keys(), value.values()) if isinstance(value, dict) else value):
            total += places(item)
            if total > MAX_PLACES:
                raise CheckpointLoadError(f"{what} is damaged or hostile: its objects, counted once per place they "
                                          f"are shared into, number more than {MAX_PLACES:,}; {ADVICE}")
        open_now.discard(key)
        counted[key] = total
        return total

    try:
        places(tree)
    except RecursionError:
        raise CheckpointLoadError(f"{what} is damaged or hostile: it nests containers deeper than "
                                  f"{sys.getrecursionlimit()} levels; {ADVICE}") from None


# Quantized dtypes that pack several elements into each byte of their storage.
_PER_BYTE = {torch.quint4x2: 2, torch.quint2x4: 4}


def _check_tensor(tensor: torch.Tensor, what: str) -> None:
    """A CheckpointLoadError for a tensor this job's saves never write: one on the meta device holds no
    data (a resume took it through every check as a number, then failed at its first use), and one that
    views more elements than its storage holds (a stride of 0: ``zeros(1).expand(2**29)``, 1.5 KB on disk)
    allocates them all once anything copies it (4.5 GB for ``job inspect``, a checkpoint of 2 GB written
    at each save). The job never writes either: its saves copy every tensor into dense memory of its own
    (job.snapshot), and DCP's writer clones a view to its own bytes."""
    if tensor.is_meta:
        raise CheckpointLoadError(f"{what} is damaged or hostile: it holds a tensor on the meta device, "
                                  f"which has no data; {ADVICE}")
    if tensor.layout == torch.strided:
        stored = tensor.untyped_storage().nbytes()
        if tensor.numel() * tensor.element_size() > stored * _PER_BYTE.get(tensor.dtype, 1):
            raise CheckpointLoadError(
                f"{what} is damaged or hostile: a tensor of shape {tuple(tensor.shape)} views {stored:,} bytes "
                f"that hold fewer than its {tensor.numel():,} elements (an expanded view, which this job's saves "
                f"never write); {ADVICE}")


def check_stored(source: Path | IO[bytes], what: str) -> None:
    """A CheckpointLoadError unless ``source`` is a zip archive (what torch.save writes) whose records
    are all stored uncompressed inside it, as torch.save stores them: then torch.load allocates no more
    than the file holds (module docstring). The stdlib's zip reader reads the archive's directory only,
    never a pickle; a file object is left where it was."""
    start = None if isinstance(source, Path) else source.tell()
    try:
        size = source.stat().st_size if isinstance(source, Path) else source.seek(0, io.SEEK_END)
        with zipfile.ZipFile(source) as archive:
            records = archive.infolist()
    except FileNotFoundError:
        raise CheckpointLoadError(f"{what} is missing") from None
    except OSError as e:
        raise CheckpointLoadError(f"{what} cannot be read ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - the stdlib's reader raises several kinds for a malformed archive
        raise CheckpointLoadError(f"{what} is not a readable torch file (not a zip archive: {first_line(e)})") from None
    finally:
        if start is not None:
            source.seek(start)
    for info in records:
        if (info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size
                or not 0 <= info.header_offset <= info.header_offset + info.compress_size <= size):
            raise CheckpointLoadError(
                f"refusing to load {what}: its record {clip(repr(info.filename), 80)} is compressed or runs past "
                "its end (torch.save stores every record as is, and a compressed one could unpack to far more "
                f"memory than the checkpoint's bytes): the checkpoint is damaged or hostile; {ADVICE}")


def unpickler_reason(e: pickle.UnpicklingError) -> str:
    """The one sentence of torch's refusal that names what the file wanted (``Unsupported global:
    GLOBAL getattr ...``). The rest advises loading it without the weights-only guard, which this job never does."""
    found = re.search(r"WeightsUnpickler error: (.+?)(?:\.\s|\.?$)", str(e), re.MULTILINE)
    return clip(found.group(1) if found else (str(e).strip().splitlines() or [type(e).__name__])[0], 160)


def first_line(e: BaseException, limit: int = 160) -> str:
    """An exception as one short line (torch's messages run over many)."""
    lines = str(e).strip().splitlines()
    return clip(lines[0] if lines else type(e).__name__, limit)
