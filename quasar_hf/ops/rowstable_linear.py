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

import ctypes
import functools

import torch

from .c_build import PORTABLE_CFLAGS, load_checked_entry, missing_cpu_flags
from .fallback import warn_fallback_once
from .reference import rowstable_linear_reference

# Variants, best first: (source, extra compiler flags, CPU flags it needs). Both compute the same bits.
VARIANTS = (
    ("rowstable_linear.c", ("-mavx512f", "-mavx512bw", "-mavx512vl"), ("avx512f", "avx512bw", "avx512vl")),
    ("rowstable_linear_avx2.c", ("-mavx2", "-mfma"), ("avx2", "fma")),
)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_MIN_BYTES_PER_THREAD = 256 * 1024  # below this a second thread costs more than it saves
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGTYPES = [_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _INT, _INT]


@functools.lru_cache(maxsize=1)
def _library() -> tuple[object | None, str | None]:
    """(entry point, None) for the best variant this CPU runs, or (None, why the kernel is unavailable here)."""
    for source, flags, required in VARIANTS:
        if not missing_cpu_flags(required):
            return load_variant(source, flags)
    return None, f"this CPU lacks {', '.join(missing_cpu_flags(VARIANTS[-1][2]))} (needs x86-64 with AVX2 and FMA, or AVX-512)"


def load_variant(source: str, flags: tuple[str, ...]) -> tuple[object | None, str | None]:
    """Build csrc/<source> with `flags`, load it and smoke-test it (tests load each variant)."""
    return load_checked_entry(
        source, "qhf_rowstable_linear", PORTABLE_CFLAGS + flags, _ARGTYPES, _smoke_test, "row-stable linear kernel"
    )


def _smoke_test(fn) -> str | None:
    """Ragged shapes against the reference, bit for bit, so a miscompiled kernel is never used."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 37, generator=gen).bfloat16()  # two row blocks, ragged K
    weight = torch.randn(10, 37, generator=gen).bfloat16()  # a full block of 4 and a tail
    bias = torch.randn(10, generator=gen).bfloat16()
    if not torch.equal(_run(fn, x, weight, bias), rowstable_linear_reference(x, weight, bias)):
        return "the built row-stable linear kernel disagrees with ops/reference.py on a smoke test (compiler problem)"
    return None


def unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not."""
    try:
        return _library()[1]
    except Exception as err:  # noqa: BLE001 - this must never raise
        return f"unexpected error while loading the row-stable linear kernel: {err!r}"


def is_available() -> bool:
    """True if the kernel built, loaded and passed its smoke test. Never raises."""
    return unavailable_reason() is None


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True if these tensors are the kernel's kind: CPU, one dtype (float32 or bfloat16), weight [N, K]
    with K = x.shape[-1] (pure checks on metadata, so `torch.compile` traces them)."""
    return (
        x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.dtype in _DTYPE_CODES
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
    fn, error = _library()
    if fn is None:
        raise RuntimeError(f"the row-stable CPU linear kernel is unavailable: {error}")
    if not supports(x, weight, bias):
        raise ValueError(
            "rowstable_linear needs CPU tensors of one dtype (float32 or bfloat16), x [..., K] and weight [N, K]"
            f"{' and bias [N]' if bias is not None else ''}; got x {tuple(x.shape)} {x.dtype}, "
            f"weight {tuple(weight.shape)} {weight.dtype}"
            f"{'' if bias is None else f', bias {tuple(bias.shape)} {bias.dtype}'}"
        )
    return _run(fn, x, weight, bias)


def _run(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel call: rows of x and of the weight need unit inner stride (copied if not)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    if out.numel():
        threads = max(1, min(torch.get_num_threads(), weight.numel() * weight.element_size() // _MIN_BYTES_PER_THREAD))
        status = fn(
            rows.data_ptr(),
            rows.stride(0),
            rows.shape[0],
            k,
            weight.data_ptr(),
            weight.stride(0),
            n,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            n,
            _DTYPE_CODES[x.dtype],
            threads,
        )
        if status == 1:
            raise MemoryError(f"row-stable linear could not allocate {rows.shape[0]} x {k} fp32 scratch")
        if status != 0:
            raise ValueError(f"row-stable linear rejected shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    return out.reshape(*x.shape[:-1], n)
