"""Numerical precision, and the autocast context that implements it."""

from __future__ import annotations

import contextlib
import logging
from enum import Enum

import torch

from state.exceptions import PrecisionError

logger = logging.getLogger(__name__)


class Precision(Enum):
    """How the forward pass is computed. AMP modes autocast on CUDA; FP32 runs anywhere."""

    FP32 = "fp32"
    AMP_FP16 = "amp_fp16"
    AMP_BF16 = "amp_bf16"

    @classmethod
    def _missing_(cls, value: object) -> Precision:
        # Same spelling rules as the CLI flag, case-insensitive, with the valid choices in the message.
        if isinstance(value, str):
            for precision in cls:
                if precision.value == value.strip().lower():
                    return precision
        valid = ", ".join(precision.value for precision in cls)
        raise ValueError(f"invalid precision {value!r}; valid values: {valid}")


_AUTOCAST_DTYPES = {Precision.AMP_FP16: torch.float16, Precision.AMP_BF16: torch.bfloat16}


def check_precision_available(precision: Precision | str) -> Precision:
    """Refuse AMP without CUDA up front: CPU autocast is a different numeric regime, not a fallback."""
    precision = Precision(precision)
    if precision is not Precision.FP32 and not torch.cuda.is_available():
        raise PrecisionError(
            f"precision {precision.value} needs a CUDA GPU and none is available; use --precision fp32 on CPU"
        )
    if precision is Precision.AMP_BF16 and not torch.cuda.is_bf16_supported():
        raise PrecisionError(
            "precision amp_bf16 needs a GPU with bfloat16 support and this one has none; use --precision amp_fp16"
        )
    return precision


def default_precision_context(precision: Precision | str) -> contextlib.AbstractContextManager[object]:
    """The context the forward pass runs in for ``precision``; State's default ``precision_context``."""
    precision = check_precision_available(precision)
    if precision is Precision.FP32:
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=_AUTOCAST_DTYPES[precision])
