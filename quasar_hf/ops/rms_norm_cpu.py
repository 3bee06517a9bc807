"""Row-stable RMSNorm on CPU (C, built at first use): what `quasar::rms_norm` runs in a compiled step.

csrc/rms_norm_rows.c reduces each row alone in an order fixed by its width (8 lanes, a fixed
tree), so a row's output never depends on how many rows the call has; the plain-PyTorch oracle
`reference.rowstable_rms_norm_reference` performs the same fp32 operations in the same order
(bit for bit on every CPU). It replaces a Python formula of eight torch ops (20-40 us per call in a
compiled step, 61 calls per SmolLM2 step) with one C call. Eager code keeps the Transformers
formula (`RowStableRMSNorm`): compiled steps need not equal eager ones.

Public API:
    unavailable_reason() -> str | None / is_available() -> bool     never raise
    fits(x, weight) -> bool                                          CPU float32/bfloat16 rows of the weight's width
    rms_norm_rows(x, weight, eps, offset, scale_in_float) -> [..., K]   contiguous, the fake op's dtype
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .c_build import PORTABLE_CFLAGS, load_checked_entry
from .fallback import warn_fallback_once
from .reference import rowstable_rms_norm_reference

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _INT, _I64, _I64, _I64, _P, _INT, _F, _F, _INT, _P, _INT]


def output_dtype(x: torch.Tensor, weight: torch.Tensor, scale_in_float: bool) -> torch.dtype:
    """x's dtype when the scale is applied in fp32 (Gemma), else the promotion of weight and x (Llama)."""
    return x.dtype if scale_in_float else torch.promote_types(weight.dtype, x.dtype)


@functools.lru_cache(maxsize=1)
def _library() -> tuple[object | None, str | None]:
    """(entry point, None), or (None, why the kernel is unavailable)."""
    return load_checked_entry(
        "rms_norm_rows.c", "qhf_rms_norm_rows", PORTABLE_CFLAGS, _ARGTYPES, _smoke_test, "row-stable RMSNorm kernel"
    )


def _smoke_test(fn) -> str | None:
    """Both formulas, bf16 and fp32, a width that is not a multiple of 8, against the oracle."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    for dtype, scale_in_float, offset in ((torch.bfloat16, False, 0.0), (torch.float32, True, 1.0)):
        x = (torch.randn(3, 77, generator=gen, device="cpu") * 3).to(dtype)
        w = torch.randn(77, generator=gen, device="cpu").to(dtype)
        if not torch.equal(
            _run(fn, x, w, 1e-6, offset, scale_in_float), rowstable_rms_norm_reference(x, w, 1e-6, offset, scale_in_float)
        ):
            return "the built RMSNorm kernel disagrees with its reference on a smoke test (compiler problem)"
    return None


def unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not."""
    try:
        return _library()[1]
    except Exception as err:  # noqa: BLE001 - this must never raise
        return f"unexpected error while loading the RMSNorm kernel: {err!r}"


def is_available() -> bool:
    """True if the kernel built, loaded and passed its smoke test. Never raises."""
    return unavailable_reason() is None


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True for CPU float32/bfloat16 rows of the weight's width (1-D, same device and kind)."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype in _DTYPE_CODES
        and weight.dtype in _DTYPE_CODES
        and x.dim() >= 1
        and weight.dim() == 1
        and x.shape[-1] == weight.shape[0]
    )


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, scale_in_float: bool) -> torch.Tensor:
    """The row-stable RMSNorm of rows x [..., K] (contiguous output); the reference where the kernel cannot run."""
    fn, reason = _library()
    if fn is None:
        warn_fallback_once("the row-stable RMSNorm CPU kernel", "its plain-PyTorch reference (same bits, slower)", reason)
    if fn is None or not fits(x, weight):
        return rowstable_rms_norm_reference(x, weight, eps, offset, scale_in_float).contiguous()
    return _run(fn, x, weight, eps, offset, scale_in_float)


def _run(fn, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, scale_in_float: bool) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    dtype = output_dtype(x, weight, scale_in_float)
    out = torch.empty(x.shape, dtype=dtype, device="cpu")
    if rows.shape[0]:
        fn(
            rows.data_ptr(), _DTYPE_CODES[x.dtype], rows.shape[0], k, rows.stride(0), w.data_ptr(), _DTYPE_CODES[w.dtype],
            eps, offset, int(scale_in_float), out.data_ptr(), _DTYPE_CODES[dtype],
        )  # fmt: skip
    return out
