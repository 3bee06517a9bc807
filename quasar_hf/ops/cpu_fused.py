"""Fused CPU W8A8 linear (AVX-512 VNNI, or AVX2): quantize -> int8 GEMM -> dequantize in one C call.

Why: at decode/verify shapes (M = 1..16 tokens) a W8A8 linear built from torch ops costs about as
much as a BF16 `F.linear`, because each of its ~10 small ops costs several microseconds. One fused
call reads each weight byte once for all rows, so it runs near memory bandwidth with a single
call's overhead. Numerics are exactly those of `ops/reference.py` (bit for bit, tested).

Two C sources, one numerics: `csrc/w8a8_vnni.c` (AVX-512 VNNI) where the CPU has it, else
`csrc/w8a8_avx2.c` (AVX2; AMD Zen 2/3, Intel before Ice Lake), which computes the same bits, so a
checkpoint gives the same logits on either kind of CPU. The one picked is compiled at first use into a
per-user cache (`$QUASAR_HF_KERNEL_CACHE`, else `$XDG_CACHE_HOME/quasar_hf/kernels`, else
`~/.cache/quasar_hf/kernels`), keyed by a hash of source + flags, and loaded with ctypes.

Public API (used lazily by `ops/dispatch.py`):
    is_available() -> bool                      never raises
    unavailable_reason() -> str | None          why not, in words
    pack_weight(weight_q) -> PackedWeight       cache it beside the int8 weight
    w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias=None, act_prescale=None, packed=None)
    bind_linear(weight_q, ...) -> linear(x) / run_prepacked(...)    once-per-weight forms
    (cpu_fused_multi.bind_linear_multi: several weights reading one input, one call)
    int8_accumulators_cpu_fused(x, weight_q, act_prescale=None, packed=None)   (tests/debug)

Inference only: no autograd. Any M works (row blocks of 6 share each weight chunk in L2); the
kernel is tuned for M <= 16. Threads: torch.get_num_threads() (OpenMP, the same libgomp pool as
torch), at most one per 32 KiB of int8 weight. Per-call overhead of this wrapper: ~10 us CPU.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .c_build import PORTABLE_CFLAGS, build_and_load, find_compiler, missing_cpu_flags

# Variants, best first: (source, extra compiler flags, CPU flags it needs). Both compute the same bits.
VARIANTS = (
    (
        "w8a8_vnni.c",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
    ),
    ("w8a8_avx2.c", ("-mavx2", "-mf16c"), ("avx2", "f16c")),
)
_MIN_BYTES_PER_THREAD = 32 * 1024  # see _thread_count and benchmarks/cpu_fused.md
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


# ---- building and loading -------------------------------------------------------------------


@dataclass(frozen=True)
class _Library:
    """The loaded kernel, or the reason it could not be had."""

    fn: object | None
    error: str | None
    lib: object | None = None  # the loaded CDLL (its other entry point: cpu_fused_multi.py)
    source: str | None = None  # which variant (VARIANTS) it is


@functools.lru_cache(maxsize=1)
def _library() -> _Library:
    """Build (once per source version) and load the best variant this CPU runs; failures become a reason."""
    for source, flags, required in VARIANTS:
        if not missing_cpu_flags(required):
            return load_variant(source, flags)
    missing = missing_cpu_flags(VARIANTS[-1][2])
    return _Library(None, f"this CPU lacks {', '.join(missing)} (needs x86-64 with AVX2, or AVX-512 VNNI)")


def load_variant(source: str, flags: tuple[str, ...]) -> _Library:
    """Build csrc/<source> with `flags`, load it and check it against the reference (tests load each variant)."""
    try:
        lib = build_and_load(source, PORTABLE_CFLAGS + flags, find_compiler())
    except (RuntimeError, OSError) as err:
        return _Library(None, f"building the fused kernel failed: {err}")
    fn = lib.qhf_w8a8_linear
    fn.restype = _INT
    fn.argtypes = [_P, _INT, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _P, _P, _INT, _P, _INT, _I64, _P, _INT]
    mismatch = _smoke_test(fn)
    return _Library(None, mismatch) if mismatch else _Library(fn, None, lib, source)


def kernel_source() -> str | None:
    """The C source of the variant in use ('w8a8_vnni.c' or 'w8a8_avx2.c'), None when unavailable."""
    return _library().source


def _smoke_test(fn) -> str | None:
    """One small call against the reference, so a miscompiled kernel is never reported available."""
    from quasar_hf.ops.reference import w8a8_linear_reference  # local: keeps import time low

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 37, generator=gen).bfloat16()  # [M, K]: 2 row blocks, ragged K
    weight_q = torch.randint(-128, 128, (20, 37), generator=gen, dtype=torch.int8)  # ragged N, -128 included
    weight_scale = torch.rand(20, generator=gen) / 100
    bias = torch.randn(20, generator=gen)
    expected = w8a8_linear_reference(x, weight_q, weight_scale, bias)
    actual = _call(fn, x, weight_q, weight_scale, bias, None, pack_weight(weight_q), want_output=True)
    if not torch.equal(actual, expected):
        return "the built kernel disagrees with ops/reference.py on a smoke test (compiler or CPU problem)"
    return None


def unavailable_reason() -> str | None:
    """None when the fused kernel can run here, else why not (missing CPU feature, compiler, build)."""
    try:
        return _library().error
    except Exception as err:  # noqa: BLE001 - this must never raise
        return f"unexpected error while loading the fused kernel: {err!r}"


def is_available() -> bool:
    """True if the CPU has AVX2 (or AVX-512 VNNI) and the kernel built and loaded. Never raises."""
    return unavailable_reason() is None


# ---- weight packing -------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedWeight:
    """int8 weight in the kernel's layout; opaque to callers, who cache it next to the weight.

    data: int8 [Np/16, Kp/4, 16, 4] (N padded to 16, K to 4, zeros); wsum128: int32 [Np],
    128 * sum_k W[n, k] (wrapping like the reference's int32 cast).
    """

    data: torch.Tensor
    wsum128: torch.Tensor
    out_features: int
    in_features: int


def pack_weight(weight_q: torch.Tensor) -> PackedWeight:
    """int8 [N, K] -> PackedWeight. Re-pack whenever the weight changes."""
    if not isinstance(weight_q, torch.Tensor) or weight_q.dtype != torch.int8 or weight_q.dim() != 2:
        raise TypeError(
            "pack_weight expects an int8 tensor [out_features, in_features]; "
            f"got {getattr(weight_q, 'dtype', type(weight_q))} {tuple(getattr(weight_q, 'shape', ()))}"
        )
    if weight_q.device.type != "cpu":
        raise ValueError(f"pack_weight needs a CPU weight, got device {weight_q.device}; move it with .cpu()")
    n, k = weight_q.shape
    n_pad, k_pad = -n % 16, -k % 4
    w = torch.nn.functional.pad(weight_q.detach(), (0, k_pad, 0, n_pad))  # [Np, Kp]
    data = w.reshape(w.shape[0] // 16, 16, w.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
    wsum128 = (w.long().sum(dim=1) * 128).to(torch.int32)  # [Np]
    return PackedWeight(data, wsum128, n, k)


# ---- validation -----------------------------------------------------------------------------


def _check_inputs(x, weight_q, weight_scale, bias, act_prescale, packed) -> None:
    """Raise TypeError/ValueError naming the problem and the fix."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPE_CODES:
        raise TypeError(f"x must be a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if not isinstance(weight_q, torch.Tensor) or weight_q.dtype != torch.int8 or weight_q.dim() != 2:
        raise TypeError("weight_q must be an int8 tensor [out_features, in_features]")
    n, k = weight_q.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1] if x.dim() else 'no'} input features, weight_q expects {k}")
    if k == 0:
        raise ValueError("in_features is 0: a W8A8 linear needs at least one input feature")
    if not isinstance(weight_scale, torch.Tensor) or tuple(weight_scale.shape) != (n,):
        raise ValueError(f"weight_scale must have shape [{n}], got {tuple(getattr(weight_scale, 'shape', ()))}")
    _check_float_vector(weight_scale, "weight_scale")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,) or bias.dtype not in _DTYPE_CODES:
            raise ValueError(f"bias must be a float32/bfloat16/float16 tensor of shape [{n}]")
    if act_prescale is not None:
        if not isinstance(act_prescale, torch.Tensor) or tuple(act_prescale.shape) != (k,):
            raise ValueError(f"act_prescale must have shape [{k}], got {tuple(getattr(act_prescale, 'shape', ()))}")
        _check_float_vector(act_prescale, "act_prescale")
    for name, t in (
        ("x", x),
        ("weight_q", weight_q),
        ("weight_scale", weight_scale),
        ("bias", bias),
        ("act_prescale", act_prescale),
    ):
        if t is not None and not t.is_cpu:
            raise ValueError(f"{name} is on {t.device}; the fused CPU kernel needs CPU tensors")
    if packed is not None:
        if not isinstance(packed, PackedWeight):
            raise TypeError(f"packed must come from pack_weight(), got {type(packed).__name__}")
        if (packed.out_features, packed.in_features) != (n, k):
            raise ValueError(
                f"packed weight is {packed.out_features}x{packed.in_features} but weight_q is "
                f"{n}x{k}; re-run pack_weight(weight_q)"
            )


def _check_float_vector(t: torch.Tensor, name: str) -> None:
    """fp32 (or bf16/fp16, which promote to fp32 exactly as in the reference); never float64."""
    if t.dtype not in _DTYPE_CODES:
        raise TypeError(f"{name} must be float32 (bfloat16/float16 accepted), got {t.dtype}; convert it with .float()")


def _require_library():
    lib = _library()
    if lib.fn is None:
        raise RuntimeError(
            f"the fused CPU W8A8 kernel is unavailable: {lib.error}. "
            "Check cpu_fused.is_available() first, or use the 'torch' backend."
        )
    return lib.fn


# ---- the call -------------------------------------------------------------------------------


def _thread_count(weight_bytes: int) -> int:
    """torch's intra-op thread count, but at most one thread per _MIN_BYTES_PER_THREAD of weight:
    below that, waking a second thread costs more than streaming the weight alone."""
    return max(1, min(torch.get_num_threads(), weight_bytes // _MIN_BYTES_PER_THREAD))


def _run(x, weight_q, weight_scale, bias, act_prescale, packed, want_output: bool) -> torch.Tensor:
    """Validated entry: y [..., N] in x.dtype (want_output) or int32 accumulators [M, N]."""
    _check_inputs(x, weight_q, weight_scale, bias, act_prescale, packed)
    fn = _require_library()
    packed = packed if packed is not None else pack_weight(weight_q)
    return _call(fn, x, weight_q, weight_scale, bias, act_prescale, packed, want_output)


def _fp32_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t as contiguous fp32, without a copy (or an op dispatch) when it already is."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def _weight_args(
    packed: PackedWeight, w_scale: torch.Tensor, bias_c: torch.Tensor | None, prescale: torch.Tensor | None, n: int
) -> tuple:
    """The C arguments from prescale to bias_dtype, in the entry point's order (weight side only)."""
    return (
        None if prescale is None else prescale.data_ptr(),
        packed.data.data_ptr(),
        packed.wsum128.data_ptr(),
        n,
        packed.data.shape[1] * 4,
        w_scale.data_ptr(),
        None if bias_c is None else bias_c.data_ptr(),
        0 if bias_c is None else _DTYPE_CODES[bias_c.dtype],
    )


def _call(fn, x, weight_q, weight_scale, bias, act_prescale, packed: PackedWeight, want_output: bool) -> torch.Tensor:
    """Lay the (already validated) tensors out for the C entry point and call it (sizes from `packed`)."""
    n, k = packed.out_features, packed.in_features
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # [M, K]; raw pointers below, so no autograd
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    prescale = None if act_prescale is None else _fp32_contiguous(act_prescale)
    w_scale = _fp32_contiguous(weight_scale)
    bias_c = bias if bias is None or bias.is_contiguous() else bias.contiguous()
    shape = (*x.shape[:-1], n) if want_output else (m, n)
    result = torch.empty(shape, dtype=x.dtype if want_output else torch.int32)
    if m == 0 or n == 0:
        return result
    status = fn(
        x2.data_ptr(),
        _DTYPE_CODES[x.dtype],
        m,
        k,
        x2.stride(0),
        *_weight_args(packed, w_scale, bias_c, prescale, n),
        result.data_ptr() if want_output else None,
        _DTYPE_CODES[x.dtype],
        n,
        None if want_output else result.data_ptr(),
        _thread_count(n * k),
    )
    if status != 0:
        raise MemoryError(f"fused W8A8 kernel could not allocate scratch for {m}x{k} activations")
    return result


def w8a8_linear_cpu_fused(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """y = W8A8(x), x [..., K] -> [..., N] in x.dtype; bit-identical to w8a8_linear_reference.

    `packed` (from pack_weight(weight_q)) avoids re-packing the weight on every call.
    """
    return _run(x, weight_q, weight_scale, bias, act_prescale, packed, want_output=True)


def run_prepacked(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    act_prescale: torch.Tensor | None,
    packed: PackedWeight,
) -> torch.Tensor:
    """w8a8_linear_cpu_fused without the checks: for callers that validated every input and
    built `packed` with pack_weight(weight_q) themselves (the `quasar::w8a8_linear` op)."""
    return _call(_require_library(), x, weight_q, weight_scale, bias, act_prescale, packed, want_output=True)


def _storages(*tensors) -> tuple:
    """What a bound linear keeps so the raw pointers it took stay valid: detached aliases of the
    tensors (a later `t.data = ...` on the original cannot free their storage)."""
    return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in tensors)


def _bad_x(x, on_bad_x, weight_q, weight_scale, bias, act_prescale) -> None:
    """Raise the caller's error for a bad x (`on_bad_x`), else this module's own."""
    if on_bad_x is not None:
        on_bad_x(x)
    _check_inputs(x, weight_q, weight_scale, bias, act_prescale, None)


def bind_linear(
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
    on_bad_x: Callable[[torch.Tensor], None] | None = None,
):
    """Validate and lay out the weight side once; return `linear(x)` with the same bits as
    w8a8_linear_cpu_fused. For a module calling the same weights every decode step: per call it
    checks x cheaply, lays it out and calls C (the weight-side pointers are taken here).
    `on_bad_x(x)` raises the caller's own error for an x that is not a CPU float tensor [..., K].
    """
    k = weight_q.shape[1] if isinstance(weight_q, torch.Tensor) and weight_q.dim() == 2 else 0
    _check_inputs(torch.empty(0, k), weight_q, weight_scale, bias, act_prescale, packed)
    fn = _require_library()
    packed = packed if packed is not None else pack_weight(weight_q)
    w_scale = _fp32_contiguous(weight_scale)
    prescale = None if act_prescale is None else _fp32_contiguous(act_prescale)
    bias_c = bias if bias is None or bias.is_contiguous() else bias.contiguous()
    n = weight_q.shape[0]
    weight_args = _weight_args(packed, w_scale, bias_c, prescale, n)
    max_threads = max(1, n * k // _MIN_BYTES_PER_THREAD)  # per call: min(torch threads, this), as _thread_count

    def linear(x: torch.Tensor) -> torch.Tensor:
        if not (isinstance(x, torch.Tensor) and x.dtype in _DTYPE_CODES and x.dim() >= 1 and x.shape[-1] == k and x.is_cpu):
            _bad_x(x, on_bad_x, weight_q, weight_scale, bias, act_prescale)
        x2 = x if x.dim() == 2 else x.reshape(-1, k)  # [M, K]
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        code = _DTYPE_CODES[x.dtype]
        result = torch.empty((*x.shape[:-1], n), dtype=x.dtype)  # [..., N]
        m = x2.shape[0]
        threads = min(torch.get_num_threads(), max_threads)
        if m and fn(x2.data_ptr(), code, m, k, x2.stride(0), *weight_args, result.data_ptr(), code, n, None, threads):
            raise MemoryError(f"fused W8A8 kernel could not allocate scratch for {m}x{k} activations")
        return result

    linear.kernel_storages = _storages(packed, w_scale, bias_c, prescale)
    return linear


def int8_accumulators_cpu_fused(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    act_prescale: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """The kernel's exact int32 accumulators [M, N] for x [..., K] (tests and debugging)."""
    ones = (
        torch.ones(weight_q.shape[0], dtype=torch.float32) if isinstance(weight_q, torch.Tensor) and weight_q.dim() == 2 else None
    )
    return _run(x, weight_q, ones, None, act_prescale, packed, want_output=False)
