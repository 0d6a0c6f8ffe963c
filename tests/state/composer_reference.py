"""What Composer v0.6 does with a timer and a State checkpoint, transcribed for the interchange tests.

This is NOT Composer's code: it is a transcription of the behaviour of Composer v0.6.0's
``composer/core/time.py`` (``Timer.state_dict``, ``Timer.load_state_dict``, the counters' updates) and of
the shape of ``State.state_dict()`` in ``composer/core/state.py`` of v0.5.0 and v0.6.0, so that the tests
can show checkpoints crossing between the two projects without installing Composer (whose v0.6 does
not run on the torch this project needs). Keep it faithful to Composer, not to spot-trainer.
"""

from __future__ import annotations

from typing import Any

import torch

# Composer v0.6.0, Timer.state_dict(): these keys, each the ``.value`` of a Time, i.e. a plain int.
TIMER_KEYS = ("epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch", "token_in_epoch")


class ComposerV06Timer:
    """Composer v0.6.0's Timer, as far as checkpoints see it."""

    def __init__(self) -> None:
        self.counters = dict.fromkeys(TIMER_KEYS, 0)

    def on_batch_complete(self, samples: int = 0, tokens: int = 0) -> None:
        for key, amount in (("batch", 1), ("sample", samples), ("token", tokens)):
            self.counters[key] += amount
            self.counters[f"{key}_in_epoch"] += amount

    def on_epoch_complete(self) -> None:
        self.counters["epoch"] += 1
        for key in ("batch_in_epoch", "sample_in_epoch", "token_in_epoch"):
            self.counters[key] = 0

    def state_dict(self) -> dict[str, Any]:
        return dict(self.counters)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Composer indexes every key (KeyError when one is missing: the bug of issue 20) and wraps each
        # value in Time(value, unit), whose constructor raises TypeError for a count that is not an int.
        loaded = {}
        for key in TIMER_KEYS:
            value = state[key]
            if not isinstance(value, int):
                raise TypeError(f"value {value} is of type {type(value)}. Units require integer values.")
            loaded[key] = value
        self.counters = loaded


def composer_state_dict(
    version: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    timer: ComposerV06Timer,
    rank_zero_seed: int,
    ddp_prefixed: bool = False,
) -> dict[str, Any]:
    """The ``"state"`` entry of a Composer checkpoint, as ``State.state_dict()`` of ``version`` writes it.

    Objects with a state are keyed by ``type(obj).__qualname__``; ``scaler=None`` gives ``{}`` (Composer's
    ``ensure_tuple(None)`` is empty). v0.5 also saves ``is_model_ddp`` and, for a DDP model, keeps DDP's
    ``module.`` prefix on the model keys; v0.6 strips it and adds ``current_metrics``.
    """
    if version not in ("v0.5", "v0.6"):
        raise ValueError(version)
    model_state = model.state_dict()
    if ddp_prefixed:
        model_state = type(model_state)((f"module.{key}", value) for key, value in model_state.items())
    state: dict[str, Any] = {"model": model_state}
    if version == "v0.5":
        state["is_model_ddp"] = ddp_prefixed
    state.update(
        {
            "optimizers": {type(optimizer).__qualname__: optimizer.state_dict()},
            "schedulers": {type(scheduler).__qualname__: scheduler.state_dict()},
            "algorithms": {},
            "callbacks": {},
            "scaler": {},
            "timer": {"Timer": timer.state_dict()},
            "rank_zero_seed": rank_zero_seed,
        }
    )
    if version == "v0.6":
        state["current_metrics"] = {"train": {"Accuracy": 0.5}}
    return state
