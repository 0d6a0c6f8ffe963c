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

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from job.exceptions import ADVICE, CheckpointLoadError
from job.loop import unwrap
from job.sharded_layout import BUFFERS, own_buffers
from state import SEED_LIMIT, TIMER_LIMIT, State
from state.display import brief, clip
from state.exceptions import StateError

# Written by every version of the job; without them a resume would silently not be one.
REQUIRED = ("model", "optimizers", "timer", "rng")
# What State.load_state_dict, and the optimizers, schedulers and metrics it drives, raise on content they cannot take.
CONTENT_ERRORS = (StateError, KeyError, RuntimeError, ValueError, TypeError, AttributeError, IndexError, OverflowError)


@dataclass(frozen=True)
class Own:
    """This run's optimizer and scheduler settings, read before anything of a checkpoint is loaded into its
    State: a sharded resume loads the optimizers while it reads the checkpoint (job.sharded), before restore."""

    settings: dict[str, tuple[bool, Any]]
    stepping: list[list[dict[str, Any]]]


def own_settings(state: State) -> Own:
    return Own(copy.deepcopy(_settings(state)), copy.deepcopy(_stepping_flags(state)))


def restore(state: State, tree: Mapping[Any, Any], source: str, step: int, timer: Mapping[str, int],
            then: Callable[[dict[str, Any]], None] | None = None, own: Own | None = None) -> None:
    """Load ``tree`` (read by job.checkpoint, handed over by job.elastic) into ``state``, then check
    what it restored against the checkpoint's manifest (``step``, ``timer``) and this run's optimizer
    (``own``: its settings before the read, read now when not given). ``then`` (job.elastic's
    Handover.finish: other ranks' metrics merged in) runs on the train metrics after loading, its
    failures the checkpoint's like the load's."""
    own = own_settings(state) if own is None else own
    missing = [name for name in REQUIRED if name not in tree]
    if missing:
        raise CheckpointLoadError(f"checkpoint {source} has no {', '.join(missing)}: it is damaged or was not "
                                  f"written by spot-trainer; {ADVICE}")
    absent = _optimizers_absent(state, tree["optimizers"])
    if absent:  # State only warns: the run would go on with the moments of a first step, not a resume
        raise CheckpointLoadError(f"checkpoint {source} is damaged: its optimizers hold no {absent} state; {ADVICE}")
    buffers = tree.get(BUFFERS)  # a sharded run's, on as many ranks: this rank's own (own_buffers)
    tree = {k: v for k, v in tree.items() if k != BUFFERS}
    try:
        state.load_state_dict(tree, strict=True)
        if buffers is not None:
            _load_own_buffers(unwrap(state.model), buffers, source)
        if then is not None:
            then(state.train_metrics)
    except CONTENT_ERRORS as e:
        raise CheckpointLoadError(
            f"checkpoint {source} does not fit this model/optimizer or is damaged ({_what_differs(e)}); "
            f"resume it with the --model it was written with, or {ADVICE}") from None
    _keep_stepping_flags(state, own.stepping)
    problem = (_timer_problem(state, step, timer) or _settings_problem(state, own.settings) or _optimizer_problem(state)
               or _range_problem(state) or _scaler_problem(state) or _plain_problem(state))
    if problem is not None:
        raise CheckpointLoadError(f"checkpoint {source} is damaged: {problem}; {ADVICE}")
    if _scale_backed_off_to_zero(state):
        raise cannot_train_on(source, "its loss scale (--precision amp_fp16) backed off to 0, as it does when "
                              "step after step overflows (a run that diverged), and from 0 every step overflows again")


def cannot_train_on(source: str, what: str) -> CheckpointLoadError:
    """A checkpoint that is no damage but a state no step can go on from (``what``: a loss scale of 0 here,
    NaN or Inf in its parameters in job.resumed_check): the state of a run that diverged, which job.checkpoint
    no longer writes (exit 8), and an older version or another tool could have."""
    return CheckpointLoadError(
        f"checkpoint {source} cannot be trained on: {what}; move it and any newer checkpoints out of --save-folder "
        "and --remote, and resume an earlier one with a lower --lr (with the same flags the same steps diverge again)")


def _load_own_buffers(model: torch.nn.Module, saved: Any, source: str) -> None:
    """Give this rank its own buffers back (own_buffers), over the copy DCP loaded into every rank. Read from
    a checkpoint, so untrusted: anything but this model's buffers (names, shapes, dtypes) is damage."""
    own = own_buffers(model)
    if not isinstance(saved, dict) or saved.keys() != own.keys():
        found = brief(list(saved)[:5], 200) if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointLoadError(f"checkpoint {source} is damaged: its rank's buffers ({found}) are not this "
                                  f"model's ({brief(list(own)[:5], 200)}); {ADVICE}")
    for name, buf in own.items():
        value = saved[name]  # CPU and strided, as a file gives them: a meta or sparse one would fail half-way
        if (not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.layout != torch.strided
                or value.is_quantized or value.shape != buf.shape or value.dtype != buf.dtype):
            raise CheckpointLoadError(f"checkpoint {source} is damaged: its rank's buffer {name} is not a "
                                      f"{buf.dtype} tensor of shape {tuple(buf.shape)}; {ADVICE}")
    with torch.no_grad():
        for name, buf in own.items():
            buf.copy_(saved[name])


def _optimizers_absent(state: State, saved: Any) -> str | None:
    """The first of this run's optimizers that the checkpoint's optimizers entry (keyed by type, as State
    writes it) lacks; None when all are there, or when the entry is no mapping (State refuses that)."""
    if not isinstance(saved, Mapping):
        return None
    return next((type(opt).__qualname__ for opt in state.optimizers if type(opt).__qualname__ not in saved), None)


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
        return f"its rank_zero_seed is {brief(seed, 40)}, not a seed"
    found = state.current_metrics  # logged as numbers at each evaluation and at the end, and saved again
    if not isinstance(found, Mapping) or not all(
            isinstance(label, str) and isinstance(values, Mapping)
            and all(isinstance(name, str) and _is_number(v) and _floats(v) for name, v in values.items())
            for label, values in found.items()):
        return "its current_metrics are not a mapping of metric values"
    return None



def _timer_problem(state: State, step: int, timer: Mapping[str, int]) -> str | None:
    """The manifest was written from the same timer: any difference is damage (a step 10**30 would
    finish the run at once, a step 0 would start it over)."""
    restored = state.timer.state_dict()
    if restored["batch"] != step:
        return f"its state is at step {restored['batch']}, its manifest at step {step}"
    for name, value in restored.items():
        if not 0 <= value < TIMER_LIMIT:
            return f"its timer's {name} is {brief(value, 40)}, beyond the 2**62 a run's counts are kept below"
    for name, value in timer.items():
        if name in restored and restored[name] != value:
            return f"its timer's {name} is {restored[name]}, its manifest's {value}"
    return None


def _optimizer_problem(state: State) -> str | None:
    """Per-parameter state (AdamW's moments) must have its parameter's shape, or be one number (``step``):
    torch's load_state_dict casts dtypes but takes any shape, and the first step would fail on it."""
    for opt in state.optimizers:
        params = {id(param) for group in opt.param_groups for param in group["params"]}
        if any(not isinstance(key, torch.Tensor) or id(key) not in params for key in opt.state):
            # torch maps the state to parameters by the ids its param_groups list, and keeps what it cannot
            # map under the id: that parameter would start its moments afresh, the resume silently not one.
            return "its optimizer holds state for a parameter id that its param_groups do not list"
        for group in opt.param_groups:
            # torch fills in the settings it added over its versions (Adam's __setstate__); any other setting
            # missing failed with a KeyError at the first step.
            missing = [key for key in opt.defaults if key not in group]
            if missing:
                return f"its {type(opt).__name__} param group has no {', '.join(map(repr, missing))}"
            problem = _group_state_problem(opt, group)
            if problem is not None:
                return problem
    return None


def _group_state_problem(opt: torch.optim.Optimizer, group: Mapping[str, Any]) -> str | None:
    """One param group's per-parameter state (empty for a parameter not stepped yet). Adam's and AdamW's
    entries are known (the job builds AdamW: job.build): without one, or with one number for its moments, the
    first step failed (KeyError, AttributeError). Another optimizer's entries are only compared between its
    parameters: one that is a tensor of the parameter's shape for one parameter is one for all."""
    expected = _expected_entries(opt, group)
    names: set[frozenset[Any]] = set()
    shaped: set[Any] = set()
    single: set[Any] = set()
    for param in group["params"]:
        per_param = opt.state.get(param, {})
        if not isinstance(per_param, Mapping):
            return f"an optimizer state of a parameter is a {type(per_param).__name__}, not a mapping"
        if not per_param:
            continue
        names.add(frozenset(per_param))
        if expected is not None and set(per_param) != expected[0] | expected[1]:
            return (f"its {type(opt).__name__} keeps {_names(per_param)} for a parameter, not "
                    f"{_names(expected[0] | expected[1])}")
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
                return f"optimizer state {brief(name, 40)} is a bool tensor"
            if isinstance(value, torch.Tensor) and value.layout != torch.strided:  # lerp_ has no sparse kernel
                return f"optimizer state {brief(name, 40)} is a {value.layout} tensor, not a dense one"
            if expected is not None and name in expected[1] and isinstance(value, torch.Tensor) and (
                    not value.is_floating_point()):  # torch writes a float32 count: an int one overflowed at +1
                return f"optimizer state {name!r} is a tensor of {value.dtype}, not of a floating-point type"
            moment = name in expected[0] if expected is not None else (
                isinstance(value, torch.Tensor) and value.dim() > 0)
            if moment:  # of the parameter's shape
                if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                    return (f"optimizer state {brief(name, 40)} is {_kind(value)} for a parameter of shape "
                            f"{tuple(param.shape)}")
                shaped.add(name)
                continue
            if not _is_number(value):
                return f"optimizer state {brief(name, 40)} is a {type(value).__name__}, not a tensor"
            # torch steps from here: a step count of nan (or inf) trained NaN weights, -1 divided by zero.
            if not _finite(value) or (name == "step" and float(value) < 0):
                return f"optimizer state {brief(name, 40)} is {brief(_plain(value), 40)}, not a finite count"
            if param.dim() > 0:  # for a parameter of no dimensions a moment is one number too
                single.add(name)
    if len(names) > 1:
        first, *others = sorted(names, key=len)
        return (f"its optimizer keeps {_names(first)} for one parameter and {_names(others[-1])} for another of "
                "the same group")
    both = shaped & single
    if both:
        return (f"optimizer state {clip(sorted(map(repr, both))[0], 40)} is one number for some parameters and a "
                "tensor of the parameter's shape for others")
    return None


def _expected_entries(opt: torch.optim.Optimizer, group: Mapping[str, Any]) -> tuple[set[str], set[str]] | None:
    """(the moments, of the parameter's shape; the counts, one number each) that ``opt`` keeps for a parameter
    it has stepped, for the optimizers whose entries are known; None for others. The group's own amsgrad says
    whether there is a third moment (_settings_problem then compares it with this run's)."""
    if isinstance(opt, torch.optim.Adam):  # AdamW too
        return {"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group.get("amsgrad") is True else set()), {"step"}
    return None


def _names(names: Any) -> str:
    return clip(", ".join(sorted(brief(name, 40) for name in names)), 200)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return brief(value, 40) if _is_number(value) else f"a {type(value).__name__}"


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


# GradScaler's own invariants: what its constructor asserts and its update keeps (a growth tracker counts
# the steps since the last change of scale, up to growth_interval; both are int32 in the update's kernel).
INT32_MAX = 2 ** 31 - 1
INT64_LIMIT = 2 ** 63
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
            return f"its GradScaler {name} is {brief(value, 40)}, not {wanted}"
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


# How this machine steps, not what a step computes: a checkpoint written by a run on a GPU with capturable or
# fused steps (capturable failed an assertion on the CPU) resumes with this run's own.
STEPPING_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def _stepping_flags(state: State) -> list[list[dict[str, Any]]]:
    return [[{key: group[key] for key in STEPPING_FLAGS if key in group} for group in opt.param_groups]
            for opt in state.optimizers]


def _keep_stepping_flags(state: State, flags: list[list[dict[str, Any]]]) -> None:
    """Put back this run's flags after torch's load_state_dict replaced the param groups with the checkpoint's
    (the same number of groups: torch checks). A checkpoint of this run's code holds the same ones."""
    for opt, groups in zip(state.optimizers, flags, strict=True):
        for group, own in zip(opt.param_groups, groups, strict=True):
            group.update(own)


def _settings(state: State) -> dict[str, tuple[bool, Any]]:
    """The optimizers' param-group settings and the schedulers' state (lr, betas, last_epoch, base_lrs...),
    by a name that says where each is, with whether it is an optimizer's. Read again after loading: torch
    replaces the param groups."""
    found: dict[str, tuple[bool, Any]] = {}
    for i, opt in enumerate(state.optimizers):
        for g, group in enumerate(opt.param_groups):
            found.update({f"{type(opt).__name__} {i} group {g} {key}": (True, value) for key, value in group.items()
                          if key != "params"})
    for i, scheduler in enumerate(state.schedulers):
        found.update({f"{type(scheduler).__name__} {i} {key}": (False, value) for key, value in vars(scheduler).items()
                      if key != "optimizer"})
    return found


def _settings_problem(state: State, before: dict[str, tuple[bool, Any]]) -> str | None:
    """Each setting that was a finite number (or a sequence of them) must still be one, of as many: a
    learning rate of "fast" failed inside AdamW at the first step, a string last_epoch in the schedule, and
    one of nan trained NaNs until --keep pruned the good checkpoints. A setting the checkpoint does not
    have is no damage (``initial_lr`` of a run that had no schedule then: job.build.refit_schedule).

    An optimizer's switches (amsgrad, maximize: True or False, None for some) are this run's code's, and a
    checkpoint of it holds the same: another value is another optimizer (amsgrad failed at the first step
    for want of its moments; maximize climbed the loss). A scheduler's switches change as it steps
    (``_is_initial``), so they only have to stay switches."""
    after = _settings(state)
    for name, (optimizer, old) in before.items():
        if name not in after:
            continue
        new = after[name][1]
        if _numeric(old):
            if not (_numeric(new) and _length(new) == _length(old)):
                return f"{name} is {brief(new, 60)}, not a number like {brief(old, 60)}"
        elif isinstance(old, (bool, str)) or old is None:
            if optimizer and not (type(new) is type(old) and new == old):
                return f"{name} is {brief(new, 60)}, this run's optimizer has {brief(old, 60)}"
            if not optimizer and old is not None and type(new) is not type(old):
                return f"{name} is {brief(new, 60)}, not a {type(old).__name__} like {brief(old, 60)}"
    return None


# What torch's Adam and AdamW constructors refuse ("Invalid learning rate"...) and load_state_dict takes: a
# negative learning rate climbs the loss, a beta of 1 or more never forgets its first gradients.
NOT_NEGATIVE = ("lr", "eps", "weight_decay")


def _range_problem(state: State) -> str | None:
    """Run after _settings_problem, so each of these that this run's optimizer has is a finite number."""
    for i, opt in enumerate(state.optimizers):
        for g, group in enumerate(opt.param_groups):
            where = f"{type(opt).__name__} {i} group {g}"
            for key in NOT_NEGATIVE:
                if _finite(group.get(key)) and float(group[key]) < 0:
                    return f"{where} {key} is {_plain(group[key])}, below 0"
            betas = group.get("betas")
            if _numeric(betas) and isinstance(betas, (list, tuple)) and not all(0 <= float(b) < 1 for b in betas):
                return f"{where} betas are {brief(betas, 60)}, not each from 0 up to 1 (not 1 itself)"
    return None


def _length(value: Any) -> int | None:
    """How many numbers a sequence setting holds (betas: 2); None for one number."""
    return len(value) if isinstance(value, (list, tuple)) else None


def _is_number(value: Any) -> bool:
    """One real number: an int or float (not a bool), or a dense tensor of one real element with data (not a
    bool either). job.safe_load refuses meta tensors already; ``float()`` of one failed past every check."""
    if isinstance(value, torch.Tensor):
        return (value.numel() == 1 and value.layout == torch.strided and not value.is_meta
                and not value.is_complex() and value.dtype != torch.bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _floats(value: Any) -> bool:
    """Whether ``float()`` takes a number (NaN and inf included: a metric may be either): an int past a
    float's range (10**400) overflows."""
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _finite(value: Any) -> bool:
    """A number torch can take: an eps of 2**70 failed the first step ("int too big to convert")."""
    if isinstance(value, int):
        return not isinstance(value, bool) and -INT64_LIMIT <= value < INT64_LIMIT
    return _is_number(value) and math.isfinite(float(value))


def _numeric(value: Any) -> bool:
    """A finite number, or a non-empty list or tuple of them (betas, base_lrs)."""
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_finite(v) for v in value)
    return _finite(value)
