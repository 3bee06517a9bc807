"""Row-stable float linear on CPU (C, built at first use): the lm_head of decode and verify steps.

Why: torch's BF16 GEMM picks its blocking and summation order by the number of rows, so the
logits of a verified row differ in the last bits from the same row's one-token decode step. At a
near-tie that can change a greedy token. This kernel computes each output element alone in an
order that depends on K only (see csrc/rowstable_linear.c; csrc/rowstable_linear_avx2.c computes the
same bits on CPUs without AVX-512), so logits are the same whatever the
number of rows; it also streams the weight once per call for up to six rows, close to the bytes
it reads. The plain-PyTorch oracle is `ops.reference.rowstable_linear_reference` (bit for bit).

Public API:
    is_available() -> bool / unavailable_reason() -> str | None     never raise
    supports(x, weight, bias=None) -> bool                           dtype/device/layout check
    rowstable_linear(x, weight, bias=None) -> [..., N] in x.dtype    inference only (no autograd)
"""

from __future__ import annotations

import torch

from . import native
from .fallback import warn_fallback_once

_DTYPES = (torch.float32, torch.bfloat16)


def unavailable_reason() -> str | None:
    """None when the kernel serves `quasar::rowstable_linear` here, else why not."""
    return native.unavailable_reason("rowstable_linear")


def is_available() -> bool:
    """True if the kernel built, loaded and passed its smoke test. Never raises."""
    return unavailable_reason() is None


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True if these tensors are the kernel's kind: CPU, one dtype (float32 or bfloat16), weight [N, K]
    with K = x.shape[-1] (pure checks on metadata, so `torch.compile` traces them)."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype in _DTYPES
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1] > 0
        and (bias is None or (bias.dtype == x.dtype and bias.device.type == "cpu" and tuple(bias.shape) == (weight.shape[0],)))
    )


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True if these tensors can go to the kernel (`fits`) and the kernel built here (if not, the
    reason is logged once)."""
    if not fits(x, weight, bias):
        return False
    reason = unavailable_reason()
    if reason is not None:
        warn_fallback_once("the row-stable CPU linear kernel", "F.linear (its rounding depends on the row count)", reason)
    return reason is None


@torch.compiler.assume_constant_result
def available_when_compiled() -> bool:
    """`is_available()` as a constant of a compiled graph (evaluated once, when Dynamo traces)."""
    return is_available()


def rowstable_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) -> [..., N] in x.dtype, each element independent of the row count."""
    error = unavailable_reason()
    if error is not None:
        raise RuntimeError(f"the row-stable CPU linear kernel is unavailable: {error}")
    if not supports(x, weight, bias):
        raise ValueError(
            "rowstable_linear needs CPU tensors of one dtype (float32 or bfloat16), x [..., K] and weight [N, K]"
            f"{' and bias [N]' if bias is not None else ''}; got x {tuple(x.shape)} {x.dtype}, "
            f"weight {tuple(weight.shape)} {weight.dtype}"
            f"{'' if bias is None else f', bias {tuple(bias.shape)} {bias.dtype}'}"
        )
    return torch.ops.quasar.rowstable_linear.default(x, weight, bias)
