"""Restoring a checkpoint's state into this run's State, and refusing content that does not hold up.

A checkpoint's bytes are verified against its manifest, but a damaged or hand-made one can be sealed
well and still hold nonsense. Without these checks it went wrong in two ways. An entry missing (no
model, an empty state) only warned: the run went on from step 0 or from random weights, and its new
checkpoints replaced the good ones of the same steps, locally and in the bucket. Content of the wrong
kind (a timer that is a number, a learning rate that is a string, moments of another shape) ended in
a traceback (exit 1), some of it only at the first step. Here every such checkpoint is a
CheckpointLoadError (exit 6) before training starts, with the earlier checkpoints untouched.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from job.exceptions import CheckpointLoadError
from job.safe_load import clip
from state import SEED_LIMIT, State
from state.exceptions import StateError

# Written by every version of the job; without them a resume would silently not be one.
REQUIRED = ("model", "optimizers", "timer", "rng")
# What State.load_state_dict, and the optimizers, schedulers and metrics it drives, raise on content they cannot take.
CONTENT_ERRORS = (StateError, KeyError, RuntimeError, ValueError, TypeError, AttributeError, IndexError, OverflowError)
ADVICE = "restore a good checkpoint, or start a new run in another --save-folder/--remote"


def restore(state: State, tree: Mapping[Any, Any], source: str, step: int, timer: Mapping[str, int],
            then: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Load ``tree`` (read by job.checkpoint, handed over by job.elastic) into ``state``, then check
    what it restored against the checkpoint's manifest (``step``, ``timer``) and this run's optimizer.
    ``then`` (job.elastic's Handover.finish: other ranks' metrics merged in) runs on the train metrics
    after loading, its failures the checkpoint's like the load's."""
    missing = [name for name in REQUIRED if name not in tree]
    if missing:
        raise CheckpointLoadError(f"checkpoint {source} has no {', '.join(missing)}: it is damaged or was not "
                                  f"written by spot-trainer; {ADVICE}")
    before = _settings(state)
    try:
        state.load_state_dict(tree, strict=True)
        if then is not None:
            then(state.train_metrics)
    except CONTENT_ERRORS as e:
        raise CheckpointLoadError(
            f"checkpoint {source} does not fit this model/optimizer or is damaged ({_what_differs(e)}); "
            f"resume it with the --model it was written with, or {ADVICE}") from None
    problem = (_timer_problem(state, step, timer) or _optimizer_problem(state) or _settings_problem(state, before)
               or _scaler_problem(state) or _plain_problem(state))
    if problem is not None:
        raise CheckpointLoadError(f"checkpoint {source} is damaged: {problem}; {ADVICE}")
    if _scale_backed_off_to_zero(state):
        raise CheckpointLoadError(
            f"checkpoint {source} cannot be trained on: its loss scale (--precision amp_fp16) backed off to 0, "
            "as it does when step after step overflows (a run that diverged), and from 0 every step overflows "
            "again; move it and any newer checkpoints out of --save-folder and --remote, and resume an earlier "
            "one with a lower --lr (with the same flags the same steps overflow again)")


def _what_differs(error: Exception) -> str:
    """One line of ``error``. torch's first line only names the module ("Error(s) in loading state_dict
    for MLP:"), the next ones say what differs, by kind: the first of each kind (missing keys, size
    mismatches...) is kept, so that a long list of one kind does not hide the others."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if lines and lines[0].startswith("Error(s) in loading state_dict"):
        kinds: dict[str, str] = {}
        for line in lines[1:]:
            kinds.setdefault(line.split(":")[0].split(" for ")[0], clip(line, 140))
        lines = list(kinds.values())
    return clip("; ".join(lines), 300) or type(error).__name__


def _plain_problem(state: State) -> str | None:
    """The plain entries State restores as they are: a seed ("x" failed the first resume on another
    number of ranks, which derives new ranks' seeds from it) and the last computed metrics."""
    seed = state.rank_zero_seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        return f"its rank_zero_seed is {clip(repr(seed), 40)}, not a seed"
    found = state.current_metrics  # logged as numbers at each evaluation and at the end
    if not isinstance(found, Mapping) or not all(isinstance(v, Mapping) and all(map(_is_number, v.values()))
                                                 for v in found.values()):
        return "its current_metrics are not a mapping of metric values"
    return None


def _timer_problem(state: State, step: int, timer: Mapping[str, int]) -> str | None:
    """The manifest was written from the same timer: any difference is damage (a step 10**30 would
    finish the run at once, a step 0 would start it over)."""
    restored = state.timer.state_dict()
    if restored["batch"] != step:
        return f"its state is at step {restored['batch']}, its manifest at step {step}"
    for name, value in timer.items():
        if name in restored and restored[name] != value:
            return f"its timer's {name} is {restored[name]}, its manifest's {value}"
    return None


def _optimizer_problem(state: State) -> str | None:
    """Per-parameter state (AdamW's moments) must have its parameter's shape, or be one number (``step``):
    torch's load_state_dict casts dtypes but takes any shape, and the first step would fail on it."""
    for opt in state.optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                per_param = opt.state.get(param, {})
                if not isinstance(per_param, Mapping):
                    return f"an optimizer state of a parameter is a {type(per_param).__name__}, not a mapping"
                for name, value in per_param.items():
                    if isinstance(value, torch.Tensor):
                        if value.dim() > 0 and value.shape != param.shape:
                            return (f"optimizer state {name!r} has shape {tuple(value.shape)} for a parameter of "
                                    f"shape {tuple(param.shape)}")
                    elif not _is_number(value):
                        return f"optimizer state {name!r} is a {type(value).__name__}, not a tensor"
    return None


# GradScaler's own invariants: what its constructor asserts and its update keeps (a growth tracker counts
# the steps since the last change of scale, up to growth_interval; both are int32 in the update's kernel).
INT32_MAX = 2 ** 31 - 1
SCALER_LIMITS: dict[str, tuple[type, Callable[[Any], bool], str]] = {
    "scale": (float, lambda v: math.isfinite(v) and v >= 0, "a finite number, 0 or above"),
    "growth_factor": (float, lambda v: math.isfinite(v) and v > 1, "a finite number above 1"),
    "backoff_factor": (float, lambda v: 0 < v < 1, "a number between 0 and 1"),
    "growth_interval": (int, lambda v: 0 < v <= INT32_MAX, "a whole number of steps from 1 to 2**31-1"),
    "_growth_tracker": (int, lambda v: 0 <= v <= INT32_MAX, "a whole number of steps from 0 to 2**31-1"),
}


def _scaler_problem(state: State) -> str | None:
    """AMP's loss scaler (``--precision amp_fp16``). ``GradScaler.load_state_dict`` takes any values: a scale
    of "x" or a growth tracker of 10**30 failed at the first step (TypeError, OverflowError)."""
    found = _scaler_state(state)
    if found is None:
        return None
    for name, (kind, holds, wanted) in SCALER_LIMITS.items():
        value = found.get(name)
        if not _scaler_number(value, kind, holds):
            return f"its GradScaler {name} is {clip(repr(value), 40)}, not {wanted}"
    if found["_growth_tracker"] >= found["growth_interval"]:  # it starts again from 0 on reaching it
        return (f"its GradScaler counted {found['_growth_tracker']} steps towards a growth_interval of "
                f"{found['growth_interval']}")
    return None


def _scale_backed_off_to_zero(state: State) -> bool:
    """A scale of 0 is one torch reaches itself: halved at every overflowing step, float32 underflows to 0
    after about 166 in a row. From there every gradient is unscaled by 1/0 and every step overflows (torch's
    CPU scaler: NaN weights after the first step). Not damage, but a run that cannot go on from here."""
    found = _scaler_state(state)
    return found is not None and found["scale"] == 0


def _scaler_state(state: State) -> dict[str, Any] | None:
    scaler = state.scaler
    if not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
        return None
    return scaler.state_dict()


def _scaler_number(value: Any, kind: type, holds: Callable[[Any], bool]) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        return False
    try:
        return holds(kind(value))
    except OverflowError:  # an int too large for a float
        return False


def _settings(state: State) -> dict[str, Any]:
    """The optimizers' param-group settings and the schedulers' state (lr, betas, last_epoch, base_lrs...),
    by a name that says where each is. Read again after loading: torch replaces the param groups."""
    found: dict[str, Any] = {}
    for i, opt in enumerate(state.optimizers):
        for g, group in enumerate(opt.param_groups):
            found.update({f"{type(opt).__name__} {i} group {g} {key}": value for key, value in group.items()
                          if key != "params"})
    for i, scheduler in enumerate(state.schedulers):
        found.update({f"{type(scheduler).__name__} {i} {key}": value for key, value in vars(scheduler).items()
                      if key != "optimizer"})
    return found


def _settings_problem(state: State, before: dict[str, Any]) -> str | None:
    """Each setting that was a finite number (or a sequence of them) must still be one, of as many: a
    learning rate of "fast" failed inside AdamW at the first step, a string last_epoch in the schedule, and
    one of nan trained NaNs until --keep pruned the good checkpoints. A setting the checkpoint does not
    have is no damage (``initial_lr`` of a run that had no schedule then: job.build.refit_schedule)."""
    after = _settings(state)
    for name, old in before.items():
        if name not in after:
            continue
        new = after[name]
        if _numeric(old) and not (_numeric(new) and _length(new) == _length(old)):
            return f"{name} is {clip(repr(new), 60)}, not a number like {clip(repr(old), 60)}"
    return None


def _length(value: Any) -> int | None:
    """How many numbers a sequence setting holds (betas: 2); None for one number."""
    return len(value) if isinstance(value, (list, tuple)) else None


def _is_number(value: Any) -> bool:
    """One real number: an int or float (not a bool), or a tensor of one real element."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return _is_number(value) and (isinstance(value, int) or math.isfinite(float(value)))


def _numeric(value: Any) -> bool:
    """A finite number, or a non-empty list or tuple of them (betas, base_lrs)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_finite(v) for v in value)
    return _finite(value)
