"""The batches the training loop counts and cuts into micro-batches (job.batches): whatever torch's
default_collate makes, string ids included, which a resume on fewer ranks cuts for gradient accumulation."""
from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
from torch.utils.data import default_collate

from job.batches import batch_size, split, to_device
from job.exceptions import ConfigError

Sample = namedtuple("Sample", ["x", "name"])


def _collated(n: int = 6) -> Any:
    """A batch as default_collate makes it of samples ``(x, y, index, "sample-<index>")``."""
    return default_collate([(torch.full((2,), float(i)), i % 2, i, f"sample-{i}") for i in range(n)])


def test_string_ids_are_cut_along_the_batch_dimension_with_the_tensors() -> None:
    batch = _collated(6)
    micros = split(batch, 3)
    assert len(micros) == 3
    for k, (x, y, index, names) in enumerate(micros):
        assert index.tolist() == [2 * k, 2 * k + 1]
        assert x[:, 0].tolist() == [2.0 * k, 2.0 * k + 1] and len(y) == 2
        assert list(names) == [f"sample-{2 * k}", f"sample-{2 * k + 1}"]


@pytest.mark.parametrize("ids", [["a", "b", "c", "d"], [10, 11, 12, 13], [0.5, 1.5, 2.5, 3.5]])
def test_a_dict_whose_first_value_is_a_list_of_plain_values_is_counted_and_cut(ids: list[Any]) -> None:
    batch = {"id": ids, "x": torch.arange(8.0).reshape(4, 2)}
    assert batch_size(batch) == 4
    micros = split(batch, 2)
    assert [m["id"] for m in micros] == [ids[:2], ids[2:]]
    assert torch.equal(torch.cat([m["x"] for m in micros]), batch["x"])


def test_a_namedtuple_batch_keeps_its_type_through_the_device_and_the_cut() -> None:
    batch = default_collate([Sample(torch.full((3,), float(i)), f"s{i}") for i in range(4)])
    moved = to_device(batch, torch.device("cpu"))
    micros = split(moved, 2)
    assert isinstance(moved, Sample) and all(isinstance(m, Sample) for m in micros)
    assert [list(m.name) for m in micros] == [["s0", "s1"], ["s2", "s3"]]
    assert batch_size(moved) == 4


def test_the_batch_size_is_the_first_tensor_s_or_batch_dim_list_s() -> None:
    assert batch_size(torch.zeros(5, 3)) == 5
    assert batch_size([["a", "b", "c"], torch.zeros(3)]) == 3
    assert batch_size({"meta": {"n": torch.tensor(7)}, "x": torch.zeros(2, 4)}) == 2  # a 0-dim tensor has no batch


@pytest.mark.parametrize(("batch", "kind"), [
    ([torch.zeros(4, 2), "one string for the whole batch"], "str"),
    ({"x": torch.zeros(4, 2), "scale": torch.tensor(2.0)}, "Tensor"),
    ((torch.zeros(4), object()), "object"),
])
def test_a_field_without_a_batch_dimension_is_a_config_error_naming_its_type(batch: Any, kind: str) -> None:
    with pytest.raises(ConfigError, match=f"cannot split a batch .* field of type {kind} ") as caught:
        split(batch, 2)
    assert "\n" not in str(caught.value) and "default_collate" in str(caught.value)


def test_a_batch_without_any_batch_dimension_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot find the batch size of a batch of type object"):
        batch_size(object())
    whole = object()
    assert split(whole, 1) == [whole]  # nothing to cut without accumulation: the batch as it is
