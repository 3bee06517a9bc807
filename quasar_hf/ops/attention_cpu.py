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
    prefill_supports(query, key, value) -> bool                     the prompt kernel (below) applies
    prefill_attention(query, key, value, scale=None) -> [B, Q, H, D]   Q <= N: the last Q of N positions

A prompt's causal self-attention (a long prefill: as many keys as queries, no mask), or its
continuation over a cache (the queries the last Q of N positions, each seeing every key up to its
own), has its own kernel, `quasar::prefill_attention` (csrc/prefill_attention_bf16.c): blocked, on the AVX512-BF16
dot-product instruction, 2.4-3.9x torch's CPU flash attention on 2 Zen 4 cores at 128-2000 tokens
(`python -m benchmarks prefill-attention`); on CPUs without it, its AVX-512F and AVX2 + FMA builds
compute the same bits with fp32 FMAs. It is no row-stable kernel (nor needs one: plain and speculative
generation run the same prefill). Where the CPU lacks AVX2 + FMA, or the tensors are not bfloat16 with a
head size that is a multiple of 32 up to 256, callers run SDPA (doctor lists which build runs here).
`rowstable_attention` calls the op `quasar::rowstable_attention` (ops/torch_ops.py), eager and
compiled alike: on CPU its C++ implementation (ops/native.py) calls this kernel. When the kernel
cannot be built, `supports` says False and logs the reason once at warning level (callers then run
SDPA, slower for verification).
"""

from __future__ import annotations

import torch

from . import native
from .fallback import warn_fallback_once
from .reference import attention_layout_ok

_DTYPES = (torch.float32, torch.bfloat16)


@torch.compiler.assume_constant_result
def unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not (a constant for torch.compile: decided once)."""
    return native.unavailable_reason("attention")


def is_available() -> bool:
    """True if the kernel built, loaded and passed its smoke test. Never raises."""
    return unavailable_reason() is None


@torch.compiler.assume_constant_result
def serves() -> bool:
    """`is_available()`, logging once why not: a constant for torch.compile, called rather than traced."""
    reason = unavailable_reason()
    if reason is not None:
        warn_fallback_once("the row-stable CPU attention kernel", "SDPA", reason)
    return reason is None


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """True if these tensors can go to the kernel: CPU, float32 or bfloat16, the layout of
    `reference.attention_layout_ok`, and the kernel built here (if not, the reason is logged once).
    Traceable: the availability answer is a constant of the graph."""
    return _fits(query, key, value) and serves()


def _fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return query.device.type == "cpu" and query.dtype in _DTYPES and attention_layout_ok(query, key, value)


@torch.compiler.assume_constant_result
def prefill_unavailable_reason() -> str | None:
    """None when the prompt kernel runs here, else why not (decided once; never raises)."""
    return native.unavailable_reason("prefill_attention")


def prefill_supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """True if `prefill_attention` takes these tensors: CPU bfloat16, query [B, H, Q, D] and key/value
    [B, KVH, N, D] with N >= Q, H divisible by KVH, D a multiple of 32 up to 256, and the kernel built
    for this CPU."""
    if query.device.type != "cpu" or query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        return False
    if any(t.dtype != torch.bfloat16 for t in (query, key, value)):
        return False
    batch, heads, length, head_dim = query.shape
    if key.shape[0] != batch or key.shape[2] < length or key.shape[3] != head_dim or heads % key.shape[1]:
        return False
    return head_dim % 32 == 0 and head_dim <= 256 and prefill_unavailable_reason() is None


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal softmax(scale * q k^T) v with the queries the last Q of the N key positions (row i sees keys
    0 .. N - Q + i; a prompt over its own keys when Q == N); returns [B, Q, H, D] bfloat16. A row gets the
    bits of the same row of the whole prompt. Raises ValueError unless `prefill_supports(query, key, value)`."""
    if not prefill_supports(query, key, value):
        reason = prefill_unavailable_reason() or "it needs CPU bfloat16 query [B, H, Q, D] and key/value [B, KVH, N >= Q, D]"
        raise ValueError(
            f"the prefill attention kernel does not take q {tuple(query.shape)} {query.dtype}, k {tuple(key.shape)} "
            f"{key.dtype}, v {tuple(value.shape)} {value.dtype}: {reason} (head size a multiple of 32 up to 256); "
            "use torch.nn.functional.scaled_dot_product_attention(is_causal=True) instead"
        )
    return torch.ops.quasar.prefill_attention(query, key, value, None if scale is None else float(scale))


def rowstable_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(scale * q k^T over visible keys) v; returns [B, Q, H, D] in query.dtype.

    query [B, H, Q, D], key/value [B, KVH, N, D] with N >= Q; visible: bool [B, Q, N] (True =
    may attend) or None for bottom-right causal (row i sees keys 0 .. N - Q + i).
    Calls the op `quasar::rowstable_attention` (on CPU: this kernel, else its fp64 fallback).
    """
    _check_inputs(query, key, value, visible)
    return torch.ops.quasar.rowstable_attention(query, key, value, visible, None if scale is None else float(scale))


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
