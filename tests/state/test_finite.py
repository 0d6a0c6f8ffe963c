"""state.finite: which tensors of a state training writes, and whether they still hold numbers."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from state import State
from state.finite import first_nonfinite, trained_tensors


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
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


def test_training_writes_the_parameters_and_the_optimizer_moments_not_the_buffers() -> None:
    state = stepped_state(Masked())
    tree = state.state_dict()
    names = [name for name, _ in trained_tensors(tree, state.parameter_names())]
    assert sorted(n for n in names if n.startswith("model.")) == ["model.linear.bias", "model.linear.weight"]
    assert {n.rsplit(".", 1)[1] for n in names if n.startswith("optimizers.AdamW.state.")} == {
        "exp_avg", "exp_avg_sq", "step"}
    assert first_nonfinite(trained_tensors(tree, state.parameter_names())) is None  # the -inf mask is no divergence
    tree["optimizers"]["AdamW"]["state"][1]["exp_avg_sq"][2] = float("inf")
    assert first_nonfinite(trained_tensors(tree, state.parameter_names())) == "optimizers.AdamW.state.1.exp_avg_sq"
    tree["model"]["linear.weight"][0, 0] = float("nan")
    assert first_nonfinite(trained_tensors(tree, state.parameter_names())) == "model.linear.weight"


@pytest.mark.parametrize("tree", [{}, {"model": None, "optimizers": 3}, {"optimizers": {"SGD": {"state": [1]}}},
                                  {"optimizers": {"SGD": {"state": {0: "x"}}}}])
def test_a_tree_of_another_shape_has_nothing_to_check(tree: dict[str, Any]) -> None:
    assert list(trained_tensors(tree, {"w"})) == []


@pytest.mark.usefixtures("gloo_group")
def test_a_ddp_models_parameter_names_are_its_state_dicts_keys() -> None:
    state = stepped_state(torch.nn.parallel.DistributedDataParallel(Masked()))
    assert state.parameter_names() == {"linear.weight", "linear.bias"} < set(state.state_dict()["model"])


def test_the_first_in_the_models_order_is_named_whatever_the_order_of_the_names_given() -> None:
    state = stepped_state(Masked())
    tree = state.state_dict()
    for name in ("linear.weight", "linear.bias"):
        tree["model"][name][0] = float("nan")
    for names in (["linear.weight", "linear.bias"], ["linear.bias", "linear.weight"]):
        assert first_nonfinite(trained_tensors(tree, names)) == "model.linear.weight"
