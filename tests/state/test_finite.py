"""state.finite: which tensors of a state training writes, and whether they still hold numbers."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from state import State
from state.finite import collapsed_loss_scale, first_nonfinite, parameter_keys, trained_tensors


class Masked(torch.nn.Module):
    """A parameter beside a buffer that holds -inf by design (a causal attention mask's)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.linear(x) + self.mask[: len(x)], dim=-1)


def stepped_state(model: torch.nn.Module) -> State:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return State(model=model, optimizers=optimizer, max_duration="1ep", rank_zero_seed=1, train_dataloader=[0])


def named(**tensors: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return list(tensors.items())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e5m2])
def test_one_nan_or_inf_anywhere_names_its_tensor(bad: float, dtype: torch.dtype) -> None:
    broken = torch.ones(1000, dtype=dtype)
    broken[617] = bad
    tensors = named(a=torch.ones(3, dtype=dtype), b=broken, c=torch.full((2,), bad, dtype=dtype))
    assert first_nonfinite(tensors) == "b"
    assert first_nonfinite(tensors[:1]) is None


def test_finite_tensors_whose_sum_overflows_are_finite() -> None:
    """The sum is the fast look; values near their type's limit overflow it, and the exact look clears them."""
    big32 = torch.full((8,), torch.finfo(torch.float32).max)
    big16 = torch.full((100_000,), torch.finfo(torch.float16).max, dtype=torch.float16)
    assert bool(torch.isinf(big32.sum()))
    assert first_nonfinite(named(big32=big32, big16=big16)) is None


def test_integers_empty_and_complex_tensors() -> None:
    ok = named(step=torch.tensor(5), empty=torch.empty(0), z=torch.ones(3, dtype=torch.cfloat))
    assert first_nonfinite(ok) is None
    assert first_nonfinite(named(z=torch.tensor([1 + 1j, complex("nan+1j")]))) == "z"


def keys(state: State, tree: dict[str, Any]) -> set[str]:
    return parameter_keys(tree["model"], state.model)


def test_training_writes_the_parameters_and_the_optimizer_moments_not_the_buffers() -> None:
    state = stepped_state(Masked())
    tree = state.state_dict()
    names = [name for name, _ in trained_tensors(tree, keys(state, tree))]
    assert sorted(n for n in names if n.startswith("model.")) == ["model.linear.bias", "model.linear.weight"]
    assert {n.rsplit(".", 1)[1] for n in names if n.startswith("optimizers.AdamW.state.")} == {
        "exp_avg", "exp_avg_sq", "step"}
    assert first_nonfinite(trained_tensors(tree, keys(state, tree))) is None  # the -inf mask is no divergence
    tree["optimizers"]["AdamW"]["state"][1]["exp_avg_sq"][2] = float("inf")
    assert first_nonfinite(trained_tensors(tree, keys(state, tree))) == "optimizers.AdamW.state.1.exp_avg_sq"
    tree["model"]["linear.weight"][0, 0] = float("nan")
    assert first_nonfinite(trained_tensors(tree, keys(state, tree))) == "model.linear.weight"


@pytest.mark.parametrize("tree", [{}, {"model": None, "optimizers": 3}, {"optimizers": {"SGD": {"state": [1]}}},
                                  {"optimizers": {"SGD": {"state": {0: "x"}}}}])
def test_a_tree_of_another_shape_has_nothing_to_check(tree: dict[str, Any]) -> None:
    assert list(trained_tensors(tree, {"w"})) == []


@pytest.mark.usefixtures("gloo_group")
def test_parameters_are_found_by_storage_under_any_wrapper_that_renames_their_keys() -> None:
    """DDP's prefix and checkpoint_wrapper's are off the state dict's keys (a hook strips the latter): a set of
    names from named_parameters() matched none of checkpoint_wrapper's, and a NaN there was never seen."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for model in (torch.nn.parallel.DistributedDataParallel(Masked()),
                  torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(4, 4)), torch.nn.Linear(4, 4))):
        model_state = model.module.state_dict() if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
            else model.state_dict()
        assert parameter_keys(model_state, model) == {k for k in model_state if k.endswith(("weight", "bias"))}
    model_state["0.weight"][0, 0] = float("nan")
    found = first_nonfinite(trained_tensors({"model": model_state}, parameter_keys(model_state, model)))
    assert found == "model.0.weight"


def test_frozen_parameters_and_copies_are_not_parameters_training_writes() -> None:
    model = Masked()
    model.linear.bias.requires_grad_(False)  # a constant kept as a frozen parameter: -inf is its business
    assert parameter_keys(model.state_dict(), model) == {"linear.weight"}
    copied = {k: v.clone() for k, v in model.state_dict().items()}  # keys come from the live state, before a copy
    assert parameter_keys(copied, model) == set()


@pytest.mark.parametrize(("scale", "collapsed"), [(0.0, True), (float("nan"), True), (float("inf"), True),
                                                  (-1.0, True), (65536.0, False), (2.0 ** -100, False)])
def test_a_loss_scale_that_backed_off_to_0_is_a_diverged_run(scale: float, collapsed: bool) -> None:
    """float16 mixed precision skips every step that overflows: the weights stay finite, the scale halves, and
    from 0 every step overflows. Only the scale tells."""
    saved = torch.amp.GradScaler("cpu", init_scale=scale).state_dict()
    found = collapsed_loss_scale({"scaler": {"GradScaler": saved}})
    if collapsed:
        assert found is not None and found[0] == "GradScaler" and (found[1] == scale or math.isnan(found[1]))
    else:
        assert found is None
    assert collapsed_loss_scale({"scaler": {"GradScaler": {}}}) is None  # disabled: no scale at all
    assert collapsed_loss_scale({"scaler": None}) is None and collapsed_loss_scale({}) is None


def test_a_tensor_torch_cannot_sum_is_skipped_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    class NoSum(torch.Tensor):
        def sum(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise NotImplementedError("no sum here")

    odd = torch.full((3,), float("nan")).as_subclass(NoSum)
    assert first_nonfinite(named(odd=odd, nan=torch.full((2,), float("nan")))) == "nan"
    assert "odd (torch.float32) was not checked for NaN or Inf: no sum here" in caplog.text


def test_the_first_in_the_models_order_is_named_whatever_the_order_of_the_names_given() -> None:
    state = stepped_state(Masked())
    tree = state.state_dict()
    for name in ("linear.weight", "linear.bias"):
        tree["model"][name][0] = float("nan")
    for names in (["linear.weight", "linear.bias"], ["linear.bias", "linear.weight"]):
        assert first_nonfinite(trained_tensors(tree, names)) == "model.linear.weight"
