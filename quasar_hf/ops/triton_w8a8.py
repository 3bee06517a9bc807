"""Fused W8A8 linear in Triton: per-token quantization + INT8 `tl.dot` + dequantizing epilogue.

One kernel, one launch. Each program owns a [BLOCK_M, BLOCK_N] output tile and
  1. scans its BLOCK_M rows of x over the full K for the row amax (and a non-finite flag),
  2. walks K again, quantizing each x tile with `floor(v + 0.5)` exactly as `ops/reference.py`
     and accumulating `tl.dot(int8, int8) -> int32`,
  3. applies `(acc * a_scale[m]) * w_scale[n] + bias[n]` in fp32 and stores in x.dtype.
The x rows are re-read by every column program; at decode/verify shapes (M <= 16) they are a
few KiB and stay in L2, while the int8 weight, read once, dominates the traffic.

Bit-exactness with the reference: divisions use `tl.math.div_rn` (IEEE round-to-nearest; a plain
`/` may lower to an approximate division on NVIDIA) and the launch passes
`enable_fp_fusion=False` so `x * inv + 0.5` and the epilogue are not contracted into FMAs.

Block sizes are picked by a small heuristic on M (no autotuning: deterministic, no warm-up cost);
under `TRITON_INTERPRET=1` (tests on CPU) tiles are tiny so the interpreter stays fast and
ragged edges get exercised. The kernel is built lazily, because `triton.jit` decides at
decoration time whether to interpret.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    raise ImportError("the 'triton' backend needs the triton package: pip install 'quasar-hf[triton]'") from exc


def interpret_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _w8a8_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, pre_ptr, out_ptr, acc_ptr, r_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, norm_eps,
    HAS_BIAS: tl.constexpr, HAS_PRESCALE: tl.constexpr, WRITE_ACC: tl.constexpr, FOLD_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """x [M, K] (any float), w int8 [N, K], ws fp32 [N] -> out [M, N] (and int32 acc when WRITE_ACC).

    FOLD_NORM: x is an RMSNorm's input and pre_ptr its scale; each row's epilogue scale carries
    r = 1 / sqrt(mean(x^2) + norm_eps) (reference.rms_factor_reference's order), written to r_ptr [M]."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_ok = rm < M
    n_ok = rn < N

    if FOLD_NORM:  # Pass 0: squares in 16 lanes over k ascending (mul, then add), lanes by a fixed tree
        r16 = tl.arange(0, 16)
        sq = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
        for k0 in range(0, K, 16):
            kk = k0 + r16
            xt = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            xt = xt.to(tl.float32)
            sq = sq + xt * xt
        sq = tl.sum(tl.reshape(sq, (BLOCK_M, 2, 8)), axis=1)  # lanes (l, l + 8): one add each
        sq = tl.sum(tl.reshape(sq, (BLOCK_M, 2, 4)), axis=1)  # (l, l + 4)
        sq = tl.sum(tl.reshape(sq, (BLOCK_M, 2, 2)), axis=1)  # (l, l + 2)
        total = tl.sum(sq, axis=1)  # (l, l + 1)
        mean = tl.math.div_rn(total, tl.full([BLOCK_M], K, tl.float32))
        r = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.math.sqrt_rn(mean + norm_eps))  # [BM]
        if tl.program_id(1) == 0:
            tl.store(r_ptr + rm, r, mask=m_ok)

    # Pass 1: row amax over the full K, and whether the row holds NaN/Inf.
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    bad = tl.zeros([BLOCK_M], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        xt = xt.to(tl.float32)
        if HAS_PRESCALE:
            xt = xt * tl.load(pre_ptr + kk, mask=k_ok, other=0.0)[None, :]
        ax = tl.abs(xt)
        finite = (ax == ax) & (ax != float("inf"))
        bad = tl.maximum(bad, tl.max(tl.where(finite, 0, 1), axis=1))
        amax = tl.maximum(amax, tl.max(tl.where(finite, ax, 0.0), axis=1))

    finite_row = bad == 0
    usable = finite_row & (amax > 0.0)
    safe = tl.where(usable, amax, 1.0)
    inv = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), safe) * 127.0  # [BM], as the reference
    a_scale = tl.where(finite_row, tl.math.div_rn(amax, tl.full([BLOCK_M], 127.0, tl.float32)), float("nan"))
    if FOLD_NORM:
        a_scale = tl.where(a_scale == 0.0, a_scale, a_scale * r)

    # Pass 2: quantize x tiles exactly as the reference, int8 dot with int32 accumulation.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        xt = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        xt = xt.to(tl.float32)
        if HAS_PRESCALE:
            xt = xt * tl.load(pre_ptr + kk, mask=k_ok, other=0.0)[None, :]
        v = tl.where(usable[:, None], xt * inv[:, None], 0.0)
        qf = tl.floor(v + 0.5)  # rows with amax < 127 / FLT_MAX: inv = Inf, so +-Inf, and NaN for zeros
        qf = tl.where(qf != qf, 0.0, tl.minimum(tl.maximum(qf, -127.0), 127.0))  # as the reference: NaN -> 0
        q = qf.to(tl.int8)  # [BM, BK]
        wt = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0)
        acc = tl.dot(q, wt, acc, out_dtype=tl.int32)  # [BM, BN] int32

    # Epilogue: (acc * a_scale[m]) * w_scale[n] + bias[n] in fp32, stored in the output dtype.
    out_mask = m_ok[:, None] & n_ok[None, :]
    if WRITE_ACC:
        tl.store(acc_ptr + rm[:, None] * N + rn[None, :], acc, mask=out_mask)
    w_scale = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


@functools.lru_cache(maxsize=2)
def _jitted_kernel(interpret: bool):
    """The jitted kernel; built per interpret mode because `triton.jit` reads it when decorating."""
    del interpret  # part of the cache key only: triton.jit reads TRITON_INTERPRET itself
    return triton.jit(_w8a8_kernel)


# Decode/verify launches want at least this many column programs (about 2 per SM on an H100/H200)
# so that enough weight loads are in flight to approach memory bandwidth.
_DECODE_MIN_PROGRAMS = 264


def _launch_config(m: int, n: int) -> dict[str, int]:
    """Block sizes and warps for an [M, N] output: decode/verify (M <= 16) vs prefill tiles."""
    if interpret_mode():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1}
    if m <= 16:  # weight streaming: the widest column tile that still gives ~2 programs per SM
        block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= _DECODE_MIN_PROGRAMS), 16)
        return {"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": 256, "num_warps": 4}
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8}


def _run(
    x2: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    act_prescale: torch.Tensor | None,
    want_acc: bool,
    norm_eps: float | None = None,
    r_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch on x2 [M, K] (K contiguous): returns (out [M, N] in x2.dtype, int32 acc [M, N] or None).
    norm_eps: fold an RMSNorm whose scale is act_prescale; r_out (fp32 [M]) receives its row factors."""
    m, k = x2.shape
    n = weight_q.shape[0]
    weight_q = weight_q if weight_q.stride(1) == 1 else weight_q.contiguous()
    # The interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest even, so under
    # TRITON_INTERPRET the kernel stores fp32 and torch does the final cast (as on the GPU).
    store_dtype = torch.float32 if interpret_mode() else x2.dtype
    out = torch.empty(m, n, dtype=store_dtype, device=x2.device)
    acc = torch.empty(m, n, dtype=torch.int32, device=x2.device) if want_acc else out
    cfg = _launch_config(m, n)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _jitted_kernel(interpret_mode())[grid](
        x2, weight_q, weight_scale,
        bias if bias is not None else weight_scale,  # dummy pointer, never read without HAS_BIAS
        act_prescale if act_prescale is not None else weight_scale,  # dummy, likewise
        out, acc, r_out if r_out is not None else weight_scale,  # r_out: written only with FOLD_NORM
        m, n, k, x2.stride(0), weight_q.stride(0), out.stride(0), 0.0 if norm_eps is None else float(norm_eps),
        HAS_BIAS=bias is not None, HAS_PRESCALE=act_prescale is not None, WRITE_ACC=want_acc,
        FOLD_NORM=norm_eps is not None,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], enable_fp_fusion=False,
    )  # fmt: skip
    return out.to(x2.dtype), (acc if want_acc else None)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [M, K] with unit stride along K (the kernel's only layout requirement)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def w8a8_linear_triton(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype with the fused kernel (inputs validated by ops.dispatch)."""
    out, _ = _run(_as_rows(x), weight_q, weight_scale, bias, act_prescale, want_acc=False)
    return out.reshape(*x.shape[:-1], weight_q.shape[0])


def w8a8_accumulators_triton(x: torch.Tensor, weight_q: torch.Tensor, act_prescale: torch.Tensor | None = None) -> torch.Tensor:
    """Debug entry: the kernel's int32 accumulators [M, N] for x [..., K] (for exactness tests)."""
    ones = torch.ones(weight_q.shape[0], dtype=torch.float32, device=x.device)
    _, acc = _run(_as_rows(x), weight_q, ones, None, act_prescale, want_acc=True)
    return acc


def bind_folded_triton(weights: tuple):
    """`folded(x, norm_scale, eps)`: one launch with the RMSNorm folded into the kernel's quantization
    (the bits of reference.w8a8_linear_rmsnorm_reference); x is one this weight takes (backends._from_fold
    checks it)."""
    weight_q, weight_scale, bias = weights

    def folded(x: torch.Tensor, norm_scale: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = _as_rows(x)  # [M, K]
        r = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)  # [M]: the kernel writes the row factors
        out, _ = _run(x2, weight_q, weight_scale, bias, norm_scale, False, eps, r)
        return out.reshape(*x.shape[:-1], weight_q.shape[0])

    return folded
