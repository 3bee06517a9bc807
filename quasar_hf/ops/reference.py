"""Plain-PyTorch reference for W8A8 numerics: the test oracle for every fast backend.

The scheme (the Quasar paper's, and SmoothQuant's O1 setting):
  * weights: symmetric per-output-channel INT8, fp32 scale `w_scale[n] = max_k |W[n, k]| / 127`;
  * activations: dynamic symmetric per-token INT8, `a_scale[m] = max_k |X[m, k]| / 127`;
  * products accumulate exactly in int32; the epilogue is
    `out[m, n] = (acc[m, n] * a_scale[m]) * w_scale[n] + bias[n]`, computed in fp32 and cast to
    the input dtype.

Rounding is `floor(v + 0.5)` on `v = x * inv` in fp32, where `inv = fl(1 / amax) * 127` (the
IEEE reciprocal, then a multiply: exactly what eager PyTorch evaluates for `127 / amax`, spelled
out so every backend can match it): cheap, branch-free and reproducible bit for bit in Triton,
so every backend can be checked for *exact* int32 accumulators.

Edge cases, identical in every backend:
  * an all-zero row quantizes to zeros with scale 0: its output is exactly `bias` (or 0);
  * a row holding NaN or +-Inf produces NaN in every output column of that row (never a
    silently finite, wrong value);
  * huge finite values are fine: the scale absorbs them (values are clamped to [-127, 127]).
"""

from __future__ import annotations

import math

import torch

QMAX = 127.0


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], fp32 scale [N]). All-zero rows get scale 0 (and zeros)."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out_features, in_features], got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    if not torch.isfinite(w).all():
        raise ValueError("weight holds NaN or Inf values; refusing to quantize a broken checkpoint")
    amax = w.abs().amax(dim=1)  # [N]
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    q = torch.floor(w * (QMAX / safe)[:, None] + 0.5).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, amax / QMAX


def fake_quantize_weight_per_channel_(w: torch.Tensor) -> torch.Tensor:
    """[N, K] finite fp32 `w`, overwritten with its dequantized weight q.float() * scale[:, None] of
    `quantize_weight_per_channel`, bit for bit (the same fp32 operations), and returned: no
    temporaries the size of w, for searches that quantize large weights many times (the alpha grid)."""
    if w.dtype != torch.float32 or w.dim() != 2:
        raise ValueError(f"expected a 2-D float32 weight, got {w.dtype} of shape {tuple(w.shape)}")
    amax = torch.linalg.vector_norm(w, ord=float("inf"), dim=1)  # [N]: max |w[n, :]|, exact
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    w.mul_((QMAX / safe)[:, None]).add_(0.5).floor_().clamp_(-QMAX, QMAX)  # the int8 values, as floats
    return w.mul_((amax / QMAX)[:, None])


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (int8 [M, K], fp32 epilogue scale [M, 1]).

    The returned scale is `amax / 127` for finite rows and NaN for rows holding NaN/Inf, so the
    epilogue turns those rows into NaN; their int8 values are zeros (defined, never garbage).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [M, 1]; NaN/Inf rows -> NaN/Inf
    finite = torch.isfinite(amax)
    usable = finite & (amax > 0)
    safe = torch.where(usable, amax, torch.ones_like(amax))
    inv = torch.reciprocal(safe) * QMAX  # [M, 1]; bit-identical to eager `QMAX / safe`
    v = torch.where(usable, xf * inv, torch.zeros_like(xf))
    q = torch.floor(v + 0.5).clamp_(-QMAX, QMAX).to(torch.int8)
    scale = torch.where(finite, amax / QMAX, torch.full_like(amax, float("nan")))
    return q, scale


def int8_matmul_reference(a_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """Exact int32 accumulators: int8 [M, K] x int8 [N, K] -> int32 [M, N].

    Computed in fp64: every partial sum is an integer below 127 * 127 * K < 2**53, so the result
    is exact in any summation order, and fp64 matmul exists on CPU and CUDA (int64 matmul does
    not exist on CUDA).
    """
    return (a_q.double() @ w_q.double().t()).to(torch.int32)


def dequantize_epilogue(
    acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """int32 [M, N] -> dtype [M, N]: (acc * a_scale[m]) * w_scale[n] + bias[n], in fp32."""
    out = acc.float() * a_scale * w_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def w8a8_linear_reference(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = W8A8(x): x [..., K] (bf16/fp16/fp32) -> [..., N] in x.dtype.

    `act_prescale` [K] (optional) multiplies x per input channel before quantization: the
    SmoothQuant factor 1/s when it could not be folded into a preceding norm.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if act_prescale is not None:
        x2 = x2.float() * act_prescale
    a_q, a_scale = quantize_per_token(x2)
    acc = int8_matmul_reference(a_q, weight_q)
    out = dequantize_epilogue(acc, a_scale, weight_scale, bias, x.dtype)
    return out.reshape(*lead, weight_q.shape[0])


def _lane_tree_sum(acc: torch.Tensor) -> torch.Tensor:
    """[..., 16] -> [...]: lanes summed (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1), in fp32."""
    for width in (8, 4, 2, 1):
        acc = acc[..., :width] + acc[..., width : 2 * width]
    return acc[..., 0]


def rms_factor_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's per-row factor 1 / sqrt(mean(x^2) + eps) [M] for x [M, K], in the C kernel's order.

    fp32: lane l adds x[k]^2 for k = l, l + 16, ... (square, then add), lanes by the fixed tree.
    """
    k_dim = x.shape[-1]
    xf = torch.nn.functional.pad(x.float(), (0, -k_dim % 16))  # [M, Kp]
    acc = torch.zeros(xf.shape[0], 16)
    for start in range(0, xf.shape[1], 16):
        chunk = xf[:, start : start + 16]
        acc = acc + chunk * chunk
    mean = _lane_tree_sum(acc) / k_dim
    return torch.reciprocal(sqrt_correctly_rounded(mean + torch.tensor(eps, dtype=torch.float32)))


def sqrt_correctly_rounded(v: torch.Tensor) -> torch.Tensor:
    """fp32 sqrt rounded to nearest, as `sqrtf` and every IEEE sqrt instruction give, on any CPU.

    torch.sqrt on x86 CPU hands contiguous fp32 tensors to MKL's vsSqrt, which is not correctly
    rounded on every CPU (on an AMD EPYC 17 % of results were 1 ulp off). Here the root is taken
    in fp64 and rounded once to fp32: for an fp32 input, sqrt lies at least 2^-50 (relative) from
    any fp32 rounding boundary, so any fp64 sqrt within a few ulps rounds to the exact fp32 result.
    """
    return torch.sqrt(v.double()).float()


def rmsnorm_quantize_reference(x: torch.Tensor, norm_scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's per-token quantization of RMSNorm(x) with the norm folded in: x [..., K] -> (int8 [M, K],
    fp32 scale [M]). Per-token quantization is blind to a row's overall scale, so the row
    x * norm_scale is quantized as it is and its scale is multiplied by rms_factor_reference: no
    rounding of the normalized activations in between. A zero row keeps scale 0."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    a_q, a_scale = quantize_per_token(x2.float() * norm_scale)
    a_scale = torch.where(a_scale == 0, a_scale, a_scale * rms_factor_reference(x2, eps)[:, None])
    return a_q, a_scale[:, 0]


def w8a8_linear_quantized_reference(
    like: torch.Tensor,
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The int8 GEMM and epilogue of W8A8 on rows already quantized (a_q int8 [M, K], a_scale fp32 [M]):
    -> [*like.shape[:-1], N] in like.dtype."""
    out = dequantize_epilogue(int8_matmul_reference(a_q, weight_q), a_scale[:, None], weight_scale, bias, like.dtype)
    return out.reshape(*like.shape[:-1], weight_q.shape[0])


def w8a8_linear_rmsnorm_reference(
    x: torch.Tensor,
    norm_scale: torch.Tensor,
    eps: float,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8(RMSNorm(x)) with the norm folded into the activation quantization, bit for bit as the
    fused CPU kernel: x [..., K] -> [..., N] in x.dtype.

    norm_scale fp32 [K]: what the norm multiplies by (its weight, 1 + weight for Gemma, times any
    SmoothQuant prescale); the quantization is rmsnorm_quantize_reference's.
    """
    return w8a8_linear_quantized_reference(x, *rmsnorm_quantize_reference(x, norm_scale, eps), weight_q, weight_scale, bias)


def rmsnorm_reference(x: torch.Tensor, norm_scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) as a folded norm outputs it: (x * norm_scale) * rms_factor, in fp32, rounded once to
    x.dtype (x [..., K], norm_scale fp32 [K]); the fused CPU kernel writes these bits beside its GEMMs."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    out = (x2.float() * norm_scale) * rms_factor_reference(x2, eps)[:, None]
    return out.to(x.dtype).reshape(x.shape)


def w8a8_folded_group_reference(x: torch.Tensor, weights: list, norm_scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """(RMSNorm(x), W8A8_0(RMSNorm(x)), ...) with the norm folded: the oracle of every backend's folded
    group. weights: [(weight_q [N_s, K], weight_scale [N_s], bias [N_s] or None)]."""
    outs = (w8a8_linear_rmsnorm_reference(x, norm_scale, eps, w, s, b) for w, s, b in weights)
    return (rmsnorm_reference(x, norm_scale, eps), *outs)


def attention_layout_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """The layout every attention kernel here takes: query [B, H, Q, D], key/value [B, KVH, N, D],
    one dtype, H a multiple of KVH (GQA)."""
    return (
        query.dim() == key.dim() == value.dim() == 4
        and key.dtype == query.dtype == value.dtype
        and key.shape == value.shape
        and key.shape[0] == query.shape[0]
        and key.shape[1] > 0
        and query.shape[1] % key.shape[1] == 0
        and query.shape[3] == key.shape[3]
    )


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention in float64, the oracle for `ops.attention_cpu`: returns [B, Q, H, D] float64.

    query [B, H, Q, D], key/value [B, KVH, N, D] (GQA: head h uses kv head h // (H // KVH));
    visible bool [B, Q, N] or None for bottom-right causal. Rows with no visible key are zeros.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if visible is None:
        rows = torch.arange(q_len)[:, None] + (kv_len - q_len)
        visible = (torch.arange(kv_len)[None, :] <= rows).expand(batch, q_len, kv_len)
    scale = head_dim**-0.5 if scale is None else scale
    k = key.double().repeat_interleave(heads // kv_heads, dim=1)  # [B, H, N, D]
    v = value.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = (query.double() @ k.transpose(-1, -2)) * scale  # [B, H, Q, N]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> zeros
    return (probs @ v).transpose(1, 2)  # [B, Q, H, D]


def rowstable_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) in the fixed order of `ops.rowstable_linear`, bit for bit.

    fp32 throughout: lane l adds x[k] * w[k] for k = l, l + 16, ... in ascending k (multiply, then
    add: two roundings), the 16 lanes are summed by the tree (l, l + 8), (l, l + 4), (l, l + 2),
    (l, l + 1), then bias is added and the result is cast to x.dtype. Every element depends on its
    own row and column only, so it is the same whatever the number of rows.
    """
    k_dim = x.shape[-1]
    pad = -k_dim % 16
    xf = torch.nn.functional.pad(x.reshape(-1, k_dim).float(), (0, pad))  # [M, Kp]
    wf = torch.nn.functional.pad(weight.float(), (0, pad))  # [N, Kp]
    acc = torch.zeros(xf.shape[0], wf.shape[0], 16)  # [M, N, lanes]
    for start in range(0, xf.shape[1], 16):
        acc = acc + xf[:, None, start : start + 16] * wf[None, :, start : start + 16]
    out = _lane_tree_sum(acc)  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def transformers_rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, scale_in_float: bool
) -> torch.Tensor:
    """An RMSNorm as Transformers' classes compute it, op for op (so the bits are theirs).

    scale_in_float=False (Llama, Mistral, Qwen2/3, Phi-3): weight * (x * rsqrt(mean(x^2) + eps)).to(dtype);
    True (Gemma 3): ((x * rsqrt(...)) * (offset + weight)) in fp32, then .to(dtype). Each row is
    reduced alone by torch's inner-dimension reduction, whatever the number of rows.
    """
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_float:
        return (h * (offset + weight.float())).type_as(x)
    if offset:
        raise ValueError("an RMSNorm that scales after the cast has no weight offset (only Gemma's (1 + w) norms do)")
    return weight * h.to(x.dtype)


def rowstable_rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, scale_in_float: bool
) -> torch.Tensor:
    """The row-stable RMSNorm (csrc/rms_norm_rows.c's oracle, bit for bit): the formulas of
    `transformers_rms_norm_reference`, with each row's sum of squares taken in a fixed order: 8
    lanes (lane j adds x[8i + j]^2, i ascending), combined ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
    """
    if offset and not scale_in_float:
        raise ValueError("an RMSNorm that scales after the cast has no weight offset (only Gemma's (1 + w) norms do)")
    h = x.to(torch.float32)
    k = h.shape[-1]
    squares = torch.nn.functional.pad(h * h, (0, -k % 8)).reshape(*h.shape[:-1], -1, 8)  # [..., ceil(K/8), 8]
    lanes = torch.zeros(*h.shape[:-1], 8, dtype=torch.float32, device=h.device)
    for i in range(squares.shape[-2]):  # + 0.0 for the padding leaves a lane unchanged
        lanes = lanes + squares[..., i, :]
    l = lanes.unbind(-1)  # noqa: E741
    total = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
    variance = total / torch.tensor(float(k)) + torch.tensor(eps, dtype=torch.float32)
    # IEEE sqrt and division: torch.sqrt on CPU may be a vectorized approximation (1 ulp off), and
    # `1.0 / t` a reciprocal op; an fp32 sqrt taken in float64 and rounded once is the exact one.
    roots = torch.tensor([math.sqrt(v) for v in variance.flatten().tolist()], dtype=torch.float64)
    scale = torch.div(torch.ones_like(variance), roots.to(torch.float32).reshape(variance.shape))
    h = h * scale[..., None]
    if scale_in_float:
        return (h * (offset + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)
