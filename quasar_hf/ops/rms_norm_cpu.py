"""Row-stable RMSNorm on CPU: what `quasar::rms_norm` runs in a compiled step (csrc/rms_norm_rows.c).

The kernel reduces each row alone in an order fixed by its width (8 lanes, a fixed tree), so a
row's output never depends on how many rows the call has; the plain-PyTorch oracle
`reference.rowstable_rms_norm_reference` performs the same fp32 operations in the same order (bit
for bit on every CPU). It replaces a Python formula of eight torch ops (20-40 us per call in a
compiled step, 61 calls per SmolLM2 step) with one C call. Eager code keeps the Transformers
formula (`RowStableRMSNorm`): compiled steps need not equal eager ones.

Public API:
    unavailable_reason() -> str | None / is_available() -> bool     never raise
    fits(x, weight) -> bool                                          CPU float32/bfloat16 rows of the weight's width
    rms_norm_rows(x, weight, eps, offset, scale_in_float) -> [..., K]   contiguous, the op's dtype
"""

from __future__ import annotations

import torch

from . import native

_DTYPES = (torch.float32, torch.bfloat16)


def output_dtype(x: torch.Tensor, weight: torch.Tensor, scale_in_float: bool) -> torch.dtype:
    """x's dtype when the scale is applied in fp32 (Gemma), else the promotion of weight and x (Llama)."""
    return x.dtype if scale_in_float else torch.promote_types(weight.dtype, x.dtype)


def unavailable_reason() -> str | None:
    """None when the kernel serves `quasar::rms_norm` here, else why not."""
    return native.unavailable_reason("rms_norm")


def is_available() -> bool:
    """True if the kernel built, loaded and passed its smoke test. Never raises."""
    return unavailable_reason() is None


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True for CPU float32/bfloat16 rows of the weight's width (1-D, same device and kind)."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype in _DTYPES
        and weight.dtype in _DTYPES
        and x.dim() >= 1
        and weight.dim() == 1
        and x.shape[-1] == weight.shape[0]
    )


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, scale_in_float: bool) -> torch.Tensor:
    """The row-stable RMSNorm of rows x [..., K] (contiguous output): the op, whose CPU fallback is the
    reference (the same bits) where the kernel cannot run."""
    native.is_available()  # the first call builds and registers the C++ implementations
    return torch.ops.quasar.rms_norm(x, weight, float(eps), float(offset), bool(scale_in_float))
