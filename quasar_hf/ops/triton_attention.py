"""Row-stable attention in Triton (GPU): the CUDA counterpart of `ops.attention_cpu`.

Split over the keys as flash-decoding is, so that a decode call (one query row per head) still
fills the GPU, with every split point fixed in advance:
  1. `_attention_chunk_kernel`, program (b * H + h, query row i, chunk s), walks keys
     [s * CHUNK, min((s + 1) * CHUNK, end_i)) in blocks of BLOCK_N with an online softmax and
     writes that chunk's (max, sum, weighted values). A row that fits in chunk 0 is finished there.
  2. `_attention_combine_kernel`, program (b * H + h, i), merges a longer row's chunks in
     ascending order: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s.
CHUNK and BLOCK_N depend on the head size only, never on the key or row count; the loops stop at
the row's own last visible key and lanes past it are masked at load time. So a row computes the
same operations on the same values whether the call has 1 query row (decode) or k+1
(verification): bit-identical rows, as the exactness of `generate(quasar=True)` needs. (A row of
one chunk gets the same bits either way: its merge multiplies by e^0 = 1.) Oracle:
`ops.reference.attention_reference`.

Verified in Triton's CPU interpreter (tests) and by an ahead-of-time compile for sm_90; its GPU
speed and the chunk size are unmeasured: `benchmarks/gpu/gpu_check.sh` times it against SDPA.
"""

from __future__ import annotations

import functools
import math

import torch

from .fallback import warn_fallback_once
from .reference import attention_layout_ok, attention_reference
from .triton_settings import interpret_mode

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _attention_chunk_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, end_ptr, out_ptr, pm_ptr, pl_ptr, pacc_ptr,
    q_sb, q_sh, q_sq, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, m_sb, m_sq,
    H, Q, D, GROUP, S, scale,
    HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (b * H + h, i, s): chunk s of row i's visible keys. A row with end <= CHUNK is written to
    out[b, i, h, :] by its chunk 0; a longer row's chunks go to the partials [B*Q*H, S] (+ [D]) for the merge."""
    bh = tl.program_id(0)
    i = tl.program_id(1)
    s = tl.program_id(2)
    b = bh // H
    h = bh % H
    kvh = h // GROUP
    end = tl.load(end_ptr + b * Q + i)  # one past the row's last visible key
    start = s * CHUNK
    alone = end <= CHUNK  # the whole row is chunk 0
    if (start < end) | (alone & (s == 0)):
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(q_ptr + b * q_sb + h * q_sh + i * q_sq + d, mask=d_ok, other=0.0).to(tl.float32)  # [BD]
        stop = tl.minimum(start + CHUNK, end)
        m = tl.full([1], float("-inf"), tl.float32)
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)  # [BN]
            ok = n < stop
            if HAS_MASK:
                ok = ok & (tl.load(mask_ptr + b * m_sb + i * m_sq + n, mask=ok, other=0) != 0)
            tile = ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + b * k_sb + kvh * k_sh + n[:, None] * k_sn + d[None, :], mask=tile, other=0.0)
            scores = tl.sum(q[None, :] * k.to(tl.float32), axis=1) * scale  # [BN]
            scores = tl.where(ok, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=0))  # [1]
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: avoid -inf - -inf
            alpha = tl.exp(m - m_use)
            p = tl.exp(scores - m_use)  # [BN], 0 where masked
            v = tl.load(v_ptr + b * v_sb + kvh * v_sh + n[:, None] * v_sn + d[None, :], mask=tile, other=0.0)
            total = total * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
            m = m_new
        row = (b * Q + i) * H + h
        if alone:
            out = tl.where(total > 0.0, acc / tl.maximum(total, 1e-30), 0.0)  # a row that sees nothing: zeros
            tl.store(out_ptr + row * D + d, out, mask=d_ok)
        else:
            one = tl.arange(0, 1)
            tl.store(pm_ptr + row * S + s + one, m)
            tl.store(pl_ptr + row * S + s + one, total)
            tl.store(pacc_ptr + (row * S + s) * D + d, acc, mask=d_ok)


def _attention_combine_kernel(
    end_ptr, out_ptr, pm_ptr, pl_ptr, pacc_ptr, H, Q, D, S,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (b * H + h, i): a row longer than one chunk, its chunks merged in ascending order."""
    bh = tl.program_id(0)
    i = tl.program_id(1)
    b = bh // H
    h = bh % H
    end = tl.load(end_ptr + b * Q + i)
    if end > CHUNK:
        parts = tl.cdiv(end, CHUNK)
        row = (b * Q + i) * H + h
        one = tl.arange(0, 1)
        big = tl.full([1], float("-inf"), tl.float32)
        for s in range(0, parts):
            big = tl.maximum(big, tl.load(pm_ptr + row * S + s + one))
        big_use = tl.where(big == float("-inf"), 0.0, big)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for s in range(0, parts):
            weight = tl.exp(tl.load(pm_ptr + row * S + s + one) - big_use)  # [1]; 0 for a chunk that saw nothing
            total = total + tl.load(pl_ptr + row * S + s + one) * weight
            acc = acc + tl.load(pacc_ptr + (row * S + s) * D + d, mask=d_ok, other=0.0) * weight
        out = tl.where(total > 0.0, acc / tl.maximum(total, 1e-30), 0.0)
        tl.store(out_ptr + row * D + d, out, mask=d_ok)


@functools.lru_cache(maxsize=2)
def _jitted_kernels(interpret: bool):
    """(chunk kernel, combine kernel), built lazily per interpret mode (`triton.jit` reads TRITON_INTERPRET
    when decorating)."""
    del interpret
    return triton.jit(_attention_chunk_kernel), triton.jit(_attention_combine_kernel)


CHUNK_BLOCKS = 2  # key blocks per chunk: 128 keys at head size 128 (64 KiB of K and V per program)


def _block_sizes(head_dim: int) -> tuple[int, int, int]:
    """(CHUNK, BLOCK_N, BLOCK_D): functions of the head size only, never of the key or row count."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 16 if interpret_mode() else max(16, 8192 // block_d)
    return CHUNK_BLOCKS * block_n, block_n, block_d


def _first_use_check(device: torch.device) -> bool:
    """Compile and run a small GQA case on `device` against the fp64 oracle."""
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (
            torch.randn(2, 4, 3, 20, generator=g),
            torch.randn(2, 2, 7, 20, generator=g),
            torch.randn(2, 2, 7, 20, generator=g),
        )
        out = rowstable_attention_triton(q.to(device), k.to(device), v.to(device), None, 0.25).cpu()
        return bool(torch.allclose(out, attention_reference(q, k, v, None, 0.25).float(), rtol=1e-4, atol=1e-5))
    except Exception:  # noqa: BLE001 - any failure means: use SDPA with row-by-row verification instead
        return False


_CHECKED: dict[torch.device, bool] = {}  # device -> passed its first-use check (built once per process)


@torch.compiler.assume_constant_result
def works_on(device: torch.device) -> bool:
    """Whether the kernel passed its first-use check on `device` (run once per device, logged once when it fails).

    Decided once, so a process never mixes this kernel with SDPA between decode and verify steps. A plain
    function, not a cache wrapper: marked as a constant, torch.compile calls it instead of tracing it on
    every torch version (Dynamo 2.11 ignores the mark on a functools cache wrapper and traces into the
    check, which builds a Generator). `rowstable_attention.decide_kernels` runs it before compiling.
    Eager attention asks on every call: a decided device costs one dict lookup.
    """
    if not isinstance(device, torch.device):
        device = torch.device(device)
    passed = _CHECKED.get(device)
    if passed is None:
        passed = _CHECKED[device] = _first_use_check(device)
        if not passed:
            warn_fallback_once("the row-stable Triton attention kernel", "SDPA", _why_not(device))
    return passed


def _why_not(device: torch.device) -> str:
    reason = _static_reason(device)
    return reason or f"the kernel failed its first-use check on {device} (compile error or wrong result)"


def _static_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on `device` before trying it, or None."""
    if triton is None:
        return "the triton package is not installed (pip install 'quasar-hf[triton]')"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    if device.type != "cuda" and not (device.type == "cpu" and interpret_mode()):
        return f"the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {device.type!r}"
    return None


def unavailable_reason(device: str | torch.device = "cuda") -> str | None:
    """None when the kernel runs on `device` (checked once by `works_on`), else why not. Never raises."""
    device = torch.device(device)
    reason = _static_reason(device)
    if reason is not None:
        return reason
    return None if works_on(device) else _why_not(device)


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """True for CUDA tensors of one float dtype in the layout of `reference.attention_layout_ok`,
    when triton is importable and the kernel passed its first-use check on that device (which logs,
    once, why not). Traceable: nothing here is a cache wrapper."""
    if not (query.device.type == "cuda" and query.dtype in _DTYPES and attention_layout_ok(query, key, value)):
        return False
    return triton is not None and works_on(query.device)


def _row_ends(visible: torch.Tensor | None, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """int32 [B, Q]: one past each row's last visible key (bottom-right causal without a mask)."""
    if visible is None:
        ends = torch.arange(q_len, device=device, dtype=torch.int32) + (kv_len - q_len + 1)
        return ends[None].expand(batch, q_len).contiguous()
    last = torch.where(visible, torch.arange(1, kv_len + 1, device=device), 0).amax(dim=-1)  # [B, Q]
    return last.to(torch.int32).contiguous()


def rowstable_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as `ops.attention_cpu.rowstable_attention`: [B, Q, H, D] in query.dtype.

    query [B, H, Q, D], key/value [B, KVH, N, D]; visible bool [B, Q, N] or None (bottom-right causal).
    Under TRITON_INTERPRET=1 it runs on CPU tensors too (that is how it is tested without a GPU).
    It is the CUDA implementation of the op `quasar::rowstable_attention` (ops/torch_ops.py), which
    model code calls.
    """
    if triton is None:
        raise RuntimeError("row-stable Triton attention needs the triton package: pip install triton")
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if kv_len < q_len or heads % kv_heads:
        raise ValueError(f"row-stable attention rejected shapes q {tuple(query.shape)}, k {tuple(key.shape)}")
    if visible is not None and (visible.dtype != torch.bool or tuple(visible.shape) != (batch, q_len, kv_len)):
        raise ValueError(
            f"visible must be a bool tensor [{batch}, {q_len}, {kv_len}], got {visible.dtype} {tuple(visible.shape)}"
        )
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    ends = _row_ends(visible, batch, q_len, kv_len, query.device)
    mask = None if visible is None else (visible if visible.stride(-1) == 1 else visible.contiguous()).view(torch.uint8)
    # The interpreter's fp32 -> bf16 store truncates; store fp32 and let torch round (as ops/triton_w8a8.py).
    out = torch.empty(batch, q_len, heads, head_dim, dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out.to(query.dtype)
    chunk, block_n, block_d = _block_sizes(head_dim)
    splits = triton.cdiv(kv_len, chunk)  # chunks of the longest possible row; shorter rows skip the rest
    rows = batch * q_len * heads
    partial_m = torch.empty(rows * splits if splits > 1 else 1, dtype=torch.float32, device=query.device)
    partial_l = torch.empty_like(partial_m)
    partial_acc = torch.empty(rows * splits * head_dim if splits > 1 else 1, dtype=torch.float32, device=query.device)
    chunk_kernel, combine_kernel = _jitted_kernels(interpret_mode())
    chunk_kernel[(batch * heads, q_len, splits)](
        query, key, value, mask if mask is not None else ends, ends, out, partial_m, partial_l, partial_acc,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        0 if mask is None else mask.stride(0), 0 if mask is None else mask.stride(1),
        heads, q_len, head_dim, heads // kv_heads, splits, 1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        HAS_MASK=mask is not None, CHUNK=chunk, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4,
        enable_fp_fusion=False,  # no FMA contraction: masked and maskless builds compute the same bits
    )  # fmt: skip
    if splits > 1:
        combine_kernel[(batch * heads, q_len)](
            ends, out, partial_m, partial_l, partial_acc, heads, q_len, head_dim, splits,
            CHUNK=chunk, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out.to(query.dtype)
