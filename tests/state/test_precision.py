"""Precision parsing and the default autocast context, on CPU and (simulated) CUDA machines."""

from __future__ import annotations

import contextlib

import pytest
import torch

from state import Precision, PrecisionError, StateError, default_precision_context


@pytest.mark.parametrize(
    ("text", "precision"),
    [
        ("fp32", Precision.FP32),
        ("amp_fp16", Precision.AMP_FP16),
        ("amp_bf16", Precision.AMP_BF16),
        ("AMP_BF16", Precision.AMP_BF16),
    ],
)
def test_precision_from_string(text: str, precision: Precision) -> None:
    assert Precision(text) is precision


def test_bad_precision_lists_the_valid_values() -> None:
    with pytest.raises(ValueError, match="invalid precision 'fp8'; valid values: fp32, amp_fp16, amp_bf16"):
        Precision("fp8")


def test_fp32_is_a_null_context() -> None:
    assert isinstance(default_precision_context("fp32"), contextlib.nullcontext)


@pytest.mark.parametrize("precision", ["amp_fp16", Precision.AMP_BF16])
def test_amp_without_cuda_is_a_one_line_precision_error(monkeypatch: pytest.MonkeyPatch, precision: object) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    value = Precision(precision).value
    expected = f"precision {value} needs a CUDA GPU and none is available; use --precision fp32 on CPU"
    with pytest.raises(PrecisionError) as error:
        default_precision_context(precision)  # type: ignore[arg-type]
    assert str(error.value) == expected
    assert isinstance(error.value, StateError) and isinstance(error.value, ValueError)


@pytest.mark.parametrize(("precision", "dtype"), [("amp_fp16", torch.float16), ("amp_bf16", torch.bfloat16)])
def test_amp_with_cuda_is_cuda_autocast(monkeypatch: pytest.MonkeyPatch, precision: str, dtype: torch.dtype) -> None:
    # Only builds the context (never enters it), so a CPU-only torch is enough to check the choice.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    context = default_precision_context(precision)
    assert isinstance(context, torch.autocast)
    assert context.device == "cuda"
    assert context.fast_dtype == dtype


def test_bf16_on_a_gpu_without_bfloat16_is_a_precision_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    with pytest.raises(PrecisionError, match="bfloat16 support.*amp_fp16"):
        default_precision_context("amp_bf16")
