"""W8A8 linear in Triton: per-token INT8 quantization, INT8 `tl.dot` with int32 accumulation, fp32 epilogue.

Per call, for any number of rows M:
  1. `_quantize_rows_kernel`, one program per row: (the folded RMSNorm's factor r,) the row amax,
     int8 rows `floor(v + 0.5)` clamped to +-127 and the row scale, as `ops/reference.py` computes them;
  2. `_gemm_kernel`, program (column tile, K split, row tile): int8 rows against BLOCK_N weight rows
     (K contiguous: the layout int8 MMA takes), int32 accumulation over its K range; with one split
     it applies the epilogue `(acc * a_scale[m]) * w_scale[n] + bias[n]` in fp32 and stores x's dtype;
  3. `_reduce_kernel`, only when K is split: the int32 partials summed, then the same epilogue.
Decode and verify calls (M <= 16: one row tile) split K so that a small N still gives about two
programs per SM, and read each activation once; prefill calls take 64/128-row tiles and one split.
Integer sums are exact in any order, so neither the split count (a function of N and K only) nor
the tiling changes a bit: each row equals the reference, whatever M or its neighbours (row-stable).

Bit-exactness with the reference: divisions and the square root use `tl.math.div_rn` /
`sqrt_rn` (IEEE round-to-nearest; a plain `/` may lower to an approximate division on NVIDIA) and
launches pass `enable_fp_fusion=False` so `x * inv + 0.5` and the epilogue are not contracted into
FMAs. Under `TRITON_INTERPRET=1` (tests on CPU) tiles are tiny so ragged edges and several K splits
get exercised. Launch settings are a heuristic until a device run tunes them
(`benchmarks/gpu/gpu_check.sh`). The kernels are built lazily, because `triton.jit` decides at
decoration time whether to interpret.
"""

from __future__ import annotations

import functools

import torch

from .triton_settings import PROGRAMS_PER_SM, device_sm_count, interpret_mode

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    raise ImportError("the 'triton' backend needs the triton package: pip install 'quasar-hf[triton]'") from exc


def _quantize_rows_kernel(
    x_ptr, pre_ptr, q_ptr, scale_ptr, r_ptr, K, stride_xm, norm_eps,
    HAS_PRESCALE: tl.constexpr, FOLD_NORM: tl.constexpr, WRITE_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program m: q[m, :] int8 and scale[m] fp32 of row m (NaN for a row with NaN/Inf); with FOLD_NORM, x is the
    RMSNorm's input, pre_ptr its scale, and scale[m] carries r[m] = 1 / sqrt(mean(x^2) + eps) (also written to
    r_ptr with WRITE_R)."""
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    if FOLD_NORM:  # squares in 16 lanes over k ascending, lanes added by a fixed tree (rms_factor_reference)
        r16 = tl.arange(0, 16)
        sq = tl.zeros([1, 16], dtype=tl.float32)
        for k0 in range(0, K, 16):
            kk = k0 + r16
            xt = tl.load(x_row + kk[None, :], mask=(kk < K)[None, :], other=0.0).to(tl.float32)
            sq = sq + xt * xt
        sq = tl.sum(tl.reshape(sq, (1, 2, 8)), axis=1)  # lanes (l, l + 8): one add each
        sq = tl.sum(tl.reshape(sq, (1, 2, 4)), axis=1)  # (l, l + 4)
        sq = tl.sum(tl.reshape(sq, (1, 2, 2)), axis=1)  # (l, l + 2)
        total = tl.sum(sq, axis=1)  # [1]: (l, l + 1)
        mean = tl.math.div_rn(total, tl.full([1], K, tl.float32))
        r = tl.math.div_rn(tl.full([1], 1.0, tl.float32), tl.math.sqrt_rn(mean + norm_eps))  # [1]
        if WRITE_R:
            tl.store(r_ptr + row + tl.arange(0, 1), r)
    rk = tl.arange(0, BLOCK_K)
    amax = tl.zeros([1], dtype=tl.float32)
    bad = tl.zeros([1], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):  # the row amax and whether it holds NaN/Inf
        kk = k0 + rk
        k_ok = kk < K
        xt = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
        if HAS_PRESCALE:
            xt = xt * tl.load(pre_ptr + kk, mask=k_ok, other=0.0)
        ax = tl.abs(xt)
        finite = (ax == ax) & (ax != float("inf"))
        bad = tl.maximum(bad, tl.max(tl.where(finite, 0, 1), axis=0))
        amax = tl.maximum(amax, tl.max(tl.where(finite, ax, 0.0), axis=0))
    finite_row = bad == 0
    usable = finite_row & (amax > 0.0)
    inv = tl.math.div_rn(tl.full([1], 1.0, tl.float32), tl.where(usable, amax, 1.0)) * 127.0
    a_scale = tl.where(finite_row, tl.math.div_rn(amax, tl.full([1], 127.0, tl.float32)), float("nan"))
    if FOLD_NORM:
        a_scale = tl.where(a_scale == 0.0, a_scale, a_scale * r)
    tl.store(scale_ptr + row + tl.arange(0, 1), a_scale)
    for k0 in range(0, K, BLOCK_K):  # quantize with floor(v + 0.5), clamp, NaN -> 0 (the reference's rule)
        kk = k0 + rk
        k_ok = kk < K
        xt = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
        if HAS_PRESCALE:
            xt = xt * tl.load(pre_ptr + kk, mask=k_ok, other=0.0)
        v = tl.where(usable, xt * inv, 0.0)
        qf = tl.floor(v + 0.5)
        qf = tl.where(qf != qf, 0.0, tl.minimum(tl.maximum(qf, -127.0), 127.0))
        tl.store(q_ptr + row * K + kk, qf.to(tl.int8), mask=k_ok)


def _gemm_kernel(
    q_ptr, scale_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, K_SPLIT, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, ONE_SPLIT: tl.constexpr, WRITE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program (j, s, i): int32 q[rows i, ks] @ w[cols j, ks]^T over K split s; the epilogue itself when
    ONE_SPLIT, else int32 partials [SPLITS * M, N] for `_reduce_kernel` (several splits only when M <= BLOCK_M)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    split = tl.program_id(1)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    m_ok = rm < M
    n_ok = rn < N
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_hi
        a = tl.load(q_ptr + rm[:, None] * K + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)  # [BM, BK]
        b = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)  # [BN, BK]
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
    mask = m_ok[:, None] & n_ok[None, :]
    if ONE_SPLIT:  # (acc * a_scale[m]) * w_scale[n] + bias[n] in fp32, stored in the output dtype
        if WRITE_ACC:
            tl.store(part_ptr + rm[:, None] * N + rn[None, :], acc, mask=mask)
        out = acc.to(tl.float32) * tl.load(scale_ptr + rm, mask=m_ok, other=0.0)[:, None]
        out = out * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (split * M + rm)[:, None] * N + rn[None, :], acc, mask=mask)


def _reduce_kernel(
    part_ptr, scale_ptr, ws_ptr, bias_ptr, out_ptr, acc_ptr, M, N, SPLITS, stride_om,
    HAS_BIAS: tl.constexpr, WRITE_ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program j: the splits' int32 partials of column tile j summed (exact in any order), then the same epilogue."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    n_ok = rn < N
    mask = m_ok[:, None] & n_ok[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for split in range(0, SPLITS):
        acc += tl.load(part_ptr + (split * M + rm)[:, None] * N + rn[None, :], mask=mask, other=0)
    if WRITE_ACC:
        tl.store(acc_ptr + rm[:, None] * N + rn[None, :], acc, mask=mask)
    out = acc.to(tl.float32) * tl.load(scale_ptr + rm, mask=m_ok, other=0.0)[:, None]
    out = out * tl.load(ws_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=2)
def jitted_kernels(interpret: bool):
    """(quantize, GEMM, reduce), built lazily per interpret mode (`triton.jit` reads TRITON_INTERPRET)."""
    del interpret
    return triton.jit(_quantize_rows_kernel), triton.jit(_gemm_kernel), triton.jit(_reduce_kernel)


DECODE_ROWS = 16  # calls of at most this many rows: one row tile, K split


def launch_config(m: int, n: int, k: int, sms: int) -> dict[str, int]:
    """Tiles, warps and the K split for an [M, K] x [N, K]^T call on a GPU of `sms` SMs; the split depends on
    N, K and the SM count only (decode launches aim at PROGRAMS_PER_SM programs per SM)."""
    if interpret_mode():  # tiny tiles: ragged edges and several splits on test shapes
        tile = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1, "QUANTIZE_K": 32, "REDUCE_N": 16}
        target = 8
    elif m <= DECODE_ROWS:
        tile = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "QUANTIZE_K": 1024, "REDUCE_N": 256}
        target = PROGRAMS_PER_SM * sms
    else:
        big = m > 64
        tile = {"BLOCK_M": 128 if big else 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8 if big else 4}
        tile.update(QUANTIZE_K=1024, REDUCE_N=256)
        target = 1  # prefill tiles fill the GPU without splitting K
    k_blocks = triton.cdiv(k, tile["BLOCK_K"])
    splits = max(1, min(k_blocks, triton.cdiv(target, triton.cdiv(n, tile["BLOCK_N"])))) if m <= DECODE_ROWS else 1
    k_split = triton.cdiv(k_blocks, splits) * tile["BLOCK_K"]  # a whole number of BLOCK_K per split
    return {**tile, "K_SPLIT": k_split, "SPLITS": triton.cdiv(k, k_split)}


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
    # TRITON_INTERPRET the kernels store fp32 and torch does the final cast (as on the GPU).
    out = torch.empty(m, n, dtype=torch.float32 if interpret_mode() else x2.dtype, device=x2.device)
    acc = torch.empty(m, n, dtype=torch.int32, device=x2.device) if want_acc else None
    if m == 0:
        return out.to(x2.dtype), acc
    cfg = launch_config(m, n, k, 1 if interpret_mode() else device_sm_count(x2.device))
    quantize, gemm, reduce = jitted_kernels(interpret_mode())
    rows = torch.empty(m, k, dtype=torch.int8, device=x2.device)  # [M, K]
    scales = torch.empty(m, dtype=torch.float32, device=x2.device)  # [M]
    dummy = weight_scale  # a pointer never read when its flag is off
    quantize[(m,)](
        x2, act_prescale if act_prescale is not None else dummy, rows, scales, r_out if r_out is not None else dummy,
        k, x2.stride(0), 0.0 if norm_eps is None else float(norm_eps),
        HAS_PRESCALE=act_prescale is not None, FOLD_NORM=norm_eps is not None, WRITE_R=r_out is not None,
        BLOCK_K=cfg["QUANTIZE_K"],
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    splits = cfg["SPLITS"]
    partials = torch.empty(splits * m, n, dtype=torch.int32, device=x2.device) if splits > 1 else acc
    bias_arg = bias if bias is not None else dummy
    gemm[(triton.cdiv(n, cfg["BLOCK_N"]), splits, triton.cdiv(m, cfg["BLOCK_M"]))](
        rows, scales, weight_q, weight_scale, bias_arg, out, partials if partials is not None else dummy,
        m, n, k, cfg["K_SPLIT"], weight_q.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, ONE_SPLIT=splits == 1, WRITE_ACC=want_acc,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
        enable_fp_fusion=False,
    )  # fmt: skip
    if splits > 1:  # only decode rows (M <= BLOCK_M): one row tile
        reduce[(triton.cdiv(n, cfg["REDUCE_N"]),)](
            partials, scales, weight_scale, bias_arg, out, acc if acc is not None else dummy, m, n, splits, out.stride(0),
            HAS_BIAS=bias is not None, WRITE_ACC=want_acc, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["REDUCE_N"],
            num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out.to(x2.dtype), acc


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
    """x [..., K] -> [..., N] in x.dtype with the quantize, GEMM (and split-K reduce) kernels; inputs validated by ops.dispatch."""
    out, _ = _run(_as_rows(x), weight_q, weight_scale, bias, act_prescale, want_acc=False)
    return out.reshape(*x.shape[:-1], weight_q.shape[0])


def w8a8_accumulators_triton(x: torch.Tensor, weight_q: torch.Tensor, act_prescale: torch.Tensor | None = None) -> torch.Tensor:
    """Debug entry: the kernel's int32 accumulators [M, N] for x [..., K] (for exactness tests)."""
    ones = torch.ones(weight_q.shape[0], dtype=torch.float32, device=x.device)
    _, acc = _run(_as_rows(x), weight_q, ones, None, act_prescale, want_acc=True)
    return acc


def bind_folded_triton(weights: tuple):
    """`folded(x, norm_scale, eps)`: one launch with the RMSNorm folded into the kernel's quantization
    (the bits of reference.w8a8_linear_rmsnorm_reference); x is one this weight takes (the caller, the
    `quasar::w8a8_folded_norm_linear` op, checked it)."""
    weight_q, weight_scale, bias = weights

    def folded(x: torch.Tensor, norm_scale: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = _as_rows(x)  # [M, K]
        out, _ = _run(x2, weight_q, weight_scale, bias, norm_scale, False, eps)
        return out.reshape(*x.shape[:-1], weight_q.shape[0])

    return folded
