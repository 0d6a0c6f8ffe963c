"""Building the model without its random initialisation when a checkpoint is about to overwrite it.

A resume from the bucket builds the model while the checkpoint downloads (job.app). The random
initialisation of the weights then competes for the CPU with the download and its hashing, and is
thrown away by the load: 0.14 s of CPU for 34M parameters on the benchmark machine, about 4 s per
billion parameters (BENCHMARKS.md, fifteenth and sixteenth sessions). Here the model is constructed on
the meta device (shapes only), and its parameters and buffers are allocated, uninitialised, on the
run's device. When no checkpoint is loaded after all (a first start), ``initialise`` builds the model
as a normal start does, from the same seed, and copies its weights in: the result, and the random
number generators' state after it, are those of a start that never deferred.

Only a model whose state_dict holds everything it computes with can be left uninitialised: a
non-persistent buffer (a rotary cache) or a plain tensor attribute would keep garbage after the load.
That cannot be seen from outside in general, so a model opts in with a class attribute
``skip_init_on_resume = True`` (job.builtin's models do); what can be seen (non-persistent buffers,
tensor attributes) is still checked, and such a model is built as usual with a warning.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

OPT_IN = "skip_init_on_resume"


def construct(factory: Callable[[], nn.Module], device: torch.device, defer: bool) -> tuple[nn.Module, bool]:
    """The model on ``device``, and whether its initialisation was deferred (then its values are garbage
    until a checkpoint is loaded into it, or ``initialise`` runs)."""
    if defer:
        try:
            with torch.device("meta"):
                shell = factory()
        except Exception as e:  # noqa: BLE001 - user code; the normal build below raises its real errors
            logger.warning("--model could not be built on the meta device (%s): built with its random "
                           "initialisation", str(e).splitlines()[0] if str(e) else type(e).__name__)
        else:
            if isinstance(shell, nn.Module) and getattr(shell, OPT_IN, False) is True:
                problem = _incomplete(shell)
                if problem is None:
                    _materialise(shell, device)
                    return shell, True
                logger.warning("%s sets %s but %s: built with its random initialisation, which a resume then "
                               "overwrites", type(shell).__name__, OPT_IN, problem)
    model = factory()
    if isinstance(model, nn.Module):
        model.to(device)
    return model, False


def initialise(model: nn.Module, factory: Callable[[], nn.Module], seed: Callable[[], None]) -> None:
    """Give a deferred model the weights a normal start gives it: ``seed()`` (job.build's seeding), the
    factory's random initialisation on the CPU as a normal start does it, copied into ``model``."""
    seed()
    fresh = factory()
    model.load_state_dict(fresh.state_dict(), strict=True)


def _incomplete(model: nn.Module) -> str | None:
    """What of ``model`` a state_dict would not restore, or None."""
    for name, module in model.named_modules():
        where = f" in {name}" if name else ""
        if module._non_persistent_buffers_set:
            return f"has non-persistent buffers{where} ({', '.join(sorted(module._non_persistent_buffers_set))})"
        tensors = sorted(key for key, value in vars(module).items() if isinstance(value, torch.Tensor))
        if tensors:
            return f"keeps tensors outside its parameters and buffers{where} ({', '.join(tensors)})"
    return None


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Allocate every parameter and buffer on ``device``, uninitialised, keeping tied ones tied.

    Not ``Module.to_empty``: its ``empty_like`` of a meta tensor goes through torch's Python reference
    implementation, whose first call imports torch.fx's symbolic shapes (0.2-0.3 s, once per process).
    """
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by the meta tensor's id, kept alive with it

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = t, nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
        return made[id(t)][1]

    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False, remove_duplicate=False),
                             *module.named_buffers(recurse=False, remove_duplicate=False)]:
            setattr(module, name, empty(tensor))
