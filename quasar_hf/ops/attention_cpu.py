"""Row-stable CPU attention (C, built at first use): decode and verification rows bit-identical.

Why: speculative verification runs attention over k+1 query rows, plain decoding over one. Torch's
SDPA takes a different code path for each shape, so a verified row differs from the decode step
in the last bits, and in a W8A8 model that can flip an INT8 rounding and change later tokens. This
kernel computes every (batch, head, row) alone, over exactly the keys it may see, in a summation
order that depends on the head size only (see csrc/rowstable_attention.c), so a row's output is
the same whatever the number of rows in the call. The plain-PyTorch oracle is
`ops.reference.attention_reference`.

Public API:
    is_available() -> bool / unavailable_reason() -> str | None     never raise
    supports(query, key, value) -> bool                             dtype/device/layout check
    rowstable_attention(query, key, value, visible=None, scale=None) -> [B, Q, H, D]
`rowstable_attention` calls the op `quasar::rowstable_attention` (ops/torch_ops.py), eager and
compiled alike: on CPU its C++ implementation (ops/native.py) calls this kernel, and without that
library the op's fallback calls it through ctypes (`kernel()`). When the kernel cannot be built,
`supports` says False and logs the reason once at warning level (callers then run SDPA, slower for
verification).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from .c_build import PORTABLE_CFLAGS, load_checked_entry, missing_cpu_flags
from .fallback import warn_fallback_once
from .reference import attention_layout_ok, attention_reference

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _I64, _I64, _I64] * 3 + [_P, _I64, _I64, _P] + [_I64] * 6 + [_F32, _INT, _INT]


def _flags() -> tuple[str, ...]:
    """AVX-512 code generation where the CPU has it, else AVX2 with FMA (the summation order and its
    fused multiply-adds are fixed either way: the portable build computes them with fmaf)."""
    if not missing_cpu_flags(("avx512f",)):
        return (*PORTABLE_CFLAGS, "-mavx512f")
    return (*PORTABLE_CFLAGS, "-mavx2", "-mfma") if not missing_cpu_flags(("avx2", "fma")) else PORTABLE_CFLAGS


def load_variant(flags: tuple[str, ...], source: str = "rowstable_attention.c") -> tuple[object | None, str | None]:
    """Build `source` (csrc/ or a path: benchmarks time a kernel before a change) with `flags` and
    load: (entry point, None) or (None, why it is unavailable)."""
    return load_checked_entry(source, "qhf_rowstable_attention", flags, _ARGTYPES, _smoke_test, "row-stable attention kernel")


@functools.lru_cache(maxsize=1)
def _library() -> tuple[object | None, str | None]:
    """The build for this CPU, loaded once per process."""
    return load_variant(_flags())


def _smoke_test(fn) -> str | None:
    """A small GQA call against the fp64 reference, so a miscompiled kernel is never used."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 20, generator=gen)
    k, v = torch.randn(2, 2, 7, 20, generator=gen), torch.randn(2, 2, 7, 20, generator=gen)
    out = torch.empty(2, 3, 4, 20)
    _call(fn, q, k, v, None, 0.25, out)
    if not torch.allclose(out, attention_reference(q, k, v, None, 0.25).float(), rtol=1e-4, atol=1e-5):
        return "the built attention kernel disagrees with ops/reference.py on a smoke test (compiler problem)"
    return None


@torch.compiler.assume_constant_result
def unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not (a constant for torch.compile: decided once)."""
    try:
        return _library()[1]
    except Exception as err:  # noqa: BLE001 - this must never raise
        return f"unexpected error while loading the attention kernel: {err!r}"


def is_available() -> bool:
    """True if the kernel built, loaded and passed its smoke test. Never raises."""
    return unavailable_reason() is None


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """True if these tensors can go to the kernel: CPU, float32 or bfloat16, the layout of
    `reference.attention_layout_ok`, and the kernel built here (if not, the reason is logged once)."""
    if not _fits(query, key, value):
        return False
    reason = unavailable_reason()
    if reason is not None:
        warn_fallback_once("the row-stable CPU attention kernel", "SDPA", reason)
    return reason is None


def _fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype in _DTYPE_CODES and attention_layout_ok(query, key, value)


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _call(fn, query, key, value, visible, scale: float, out: torch.Tensor) -> None:
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    mask_args = (None, 0, 0) if visible is None else (visible.data_ptr(), visible.stride(0), visible.stride(1))
    status = fn(
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        *mask_args,
        out.data_ptr(),
        batch,
        heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
        scale,
        _DTYPE_CODES[query.dtype],
        max(1, torch.get_num_threads()),
    )
    if status == 1:
        raise MemoryError(f"row-stable attention could not allocate scratch for {kv_len} keys")
    if status != 0:
        raise ValueError(f"row-stable attention rejected shapes q {tuple(query.shape)}, k {tuple(key.shape)}")


def rowstable_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    kernel: object | None = None,
) -> torch.Tensor:
    """softmax(scale * q k^T over visible keys) v; returns [B, Q, H, D] in query.dtype.

    query [B, H, Q, D], key/value [B, KVH, N, D] with N >= Q; visible: bool [B, Q, N] (True =
    may attend) or None for bottom-right causal (row i sees keys 0 .. N - Q + i).
    kernel: an entry point from `load_variant` called through ctypes (tests compare builds); default:
    the op `quasar::rowstable_attention`.
    """
    if kernel is None:
        _check_inputs(query, key, value, visible)
        return torch.ops.quasar.rowstable_attention(query, key, value, visible, None if scale is None else float(scale))
    return _rowstable_attention(query, key, value, visible, scale, kernel)


def kernel() -> object:
    """This CPU's build of the kernel (a ctypes entry point); RuntimeError naming why it is unavailable."""
    fn, error = _library()
    if fn is None:
        raise RuntimeError(f"row-stable CPU attention is unavailable: {error}")
    return fn


def _check_inputs(query, key, value, visible) -> None:
    """ValueError naming what is wrong with these inputs, if anything (the kernel's contract)."""
    if not _fits(query, key, value):
        raise ValueError(
            "row-stable attention needs CPU tensors of one dtype (float32 or bfloat16), query [B, H, Q, D] and "
            f"key/value [B, KVH, N, D] with H divisible by KVH; got q {tuple(query.shape)} {query.dtype}, "
            f"k {tuple(key.shape)} {key.dtype}, v {tuple(value.shape)} {value.dtype}"
        )
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if kv_len < q_len:
        raise ValueError(f"row-stable attention needs at least as many keys ({kv_len}) as query rows ({q_len})")
    if visible is not None and (visible.dtype != torch.bool or tuple(visible.shape) != (batch, q_len, kv_len)):
        raise ValueError(
            f"visible must be a bool tensor [{batch}, {q_len}, {kv_len}], got {visible.dtype} {tuple(visible.shape)}"
        )


def _rowstable_attention(query, key, value, visible, scale, fn) -> torch.Tensor:
    """One ctypes call of the kernel `fn`: validate, lay out, run."""
    _check_inputs(query, key, value, visible)
    batch, heads, q_len, head_dim = query.shape
    if visible is not None:
        visible = _inner_contiguous(visible).view(torch.uint8)
    out = torch.empty(batch, q_len, heads, head_dim, dtype=query.dtype)
    if out.numel() == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    _call(fn, _inner_contiguous(query), _inner_contiguous(key), _inner_contiguous(value), visible, scale, out)
    return out
