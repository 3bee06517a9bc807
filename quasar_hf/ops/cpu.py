"""W8A8 linear through `torch._int_mm`: the portable fast path (CPU, and CUDA for M > 16).

Numerics are bit-identical to `ops/reference.py`: the same per-token quantization (rewritten with
fewer, in-place torch ops), exact int32 accumulators from `torch._int_mm`, and the same fp32
epilogue `(acc * a_scale[m]) * w_scale[n] + bias[n]`.

Why so few ops: at decode shapes (SmolLM2: K, N in 192..1536, M = 1..16) each eager torch op
costs a few microseconds, comparable to the matmul itself, so op count is the cost model.

Weight layout on CPU (measured on this machine, 1 thread, K = N = 4096, 6 weight copies cycled,
machine shared): `torch._int_mm(q [M, K], w.t())` with `w` stored [N, K] takes 2.9 ms at M = 1
(vs 9.0 ms with a [K, N] copy), while for M = 2..16 the contiguous [K, N] copy takes 8-11 ms vs
19-22 ms for the [N, K] view. `prepare_cpu_weight` builds that copy once (one more int8 copy of
the weight, i.e. the bytes of the BF16 weight); `w8a8_linear_torch` picks the layout from M.
torch's int8 GEMM for M > 1 stays ~3x slower than its M = 1 path: the fused C kernel
(`ops/cpu_fused.py`) is the fast CPU backend, this one is the portable fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quasar_hf.ops.reference import QMAX

# CUDA `torch._int_mm` requires M > 16 and K, N multiples of 8.
_CUDA_MIN_M = 17


@dataclass(frozen=True)
class TorchPackedWeight:
    """The int8 weight in both layouts `torch._int_mm` likes: [N, K] for M = 1, [K, N] for M > 1."""

    weight_kn: torch.Tensor  # int8 [K, N], contiguous


def prepare_cpu_weight(weight_q: torch.Tensor) -> TorchPackedWeight:
    """int8 [N, K] -> packed weight holding a contiguous int8 [K, N] copy (for M > 1 calls)."""
    return TorchPackedWeight(weight_kn=weight_q.t().contiguous())


def quantize_per_token_fast(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (int8 [M, K], fp32 scale [M, 1]); int8 values bit-identical to the reference.

    One `nan_to_num_` replaces the reference's masks, row by row:
      * finite rows with amax >= 127 / FLT_MAX: |v| <= 127 * (1 + 2 ulp), nothing to fix;
      * all-zero rows: inv = Inf, 0 * Inf = NaN -> 0 (the reference's zeros);
      * tiny rows (0 < amax < 127 / FLT_MAX ~ 3.7e-37): inv overflows to Inf, so nonzero
        entries become +-Inf -> +-127 and zeros NaN -> 0, exactly the reference's values;
      * NaN rows: inv = NaN -> 0; +-Inf rows: inv = 0, Inf * 0 = NaN -> 0 (reference: zeros).
    The only difference, invisible in the linear's output: rows holding +-Inf get scale +Inf
    instead of NaN (their int8 values are all zero, so the epilogue computes 0 * Inf = NaN).
    """
    xf = x2 if x2.dtype == torch.float32 else x2.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [M, 1]; NaN/Inf rows -> NaN/Inf
    inv = amax.reciprocal().mul_(QMAX)  # [M, 1], bit-identical to the reference's inv
    v = xf * inv  # [M, K]
    q = v.add_(0.5).floor_().nan_to_num_(nan=0.0, posinf=QMAX, neginf=-QMAX).to(torch.int8)
    return q, amax / QMAX


def _int_mm_cpu(a_q: torch.Tensor, weight_q: torch.Tensor, packed: TorchPackedWeight | None) -> torch.Tensor:
    """int8 [M, K] x int8 [N, K] -> int32 [M, N] on CPU, choosing the faster weight layout for M."""
    if a_q.shape[0] > 1 and packed is not None:
        return torch._int_mm(a_q, packed.weight_kn)
    return torch._int_mm(a_q, weight_q.t())


def _int_mm_cuda(a_q: torch.Tensor, weight_q: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] x int8 [N, K] -> int32 [M, N] on CUDA: pads M up to 17 (the kernel needs M > 16)."""
    m, k = a_q.shape
    n = weight_q.shape[0]
    if k % 8 or n % 8:  # cuBLASLt int8 constraint: fall back to an exact fp64 product
        return (a_q.double() @ weight_q.double().t()).to(torch.int32)
    if m >= _CUDA_MIN_M:
        return torch._int_mm(a_q, weight_q.t())
    padded = torch.zeros(_CUDA_MIN_M, k, dtype=torch.int8, device=a_q.device)
    padded[:m] = a_q
    return torch._int_mm(padded, weight_q.t())[:m]


def int8_matmul_torch(a_q: torch.Tensor, weight_q: torch.Tensor, packed: TorchPackedWeight | None = None) -> torch.Tensor:
    """Exact int32 accumulators via `torch._int_mm`: int8 [M, K] x int8 [N, K] -> int32 [M, N]."""
    if a_q.is_cuda:
        return _int_mm_cuda(a_q, weight_q)
    return _int_mm_cpu(a_q, weight_q, packed)


def w8a8_linear_torch(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
    packed: TorchPackedWeight | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype, bit-identical to `w8a8_linear_reference`.

    Inputs are assumed validated (see `ops.dispatch.w8a8_linear`). `packed` (optional, from
    `prepare_cpu_weight`) supplies the [K, N] layout used on CPU when M > 1.
    """
    a_q, a_scale = quantize_activations_torch(x, act_prescale)
    return linear_from_quantized_torch(a_q, a_scale, weight_q, weight_scale, bias, packed, x.dtype, x.shape[:-1])


def quantize_activations_torch(x: torch.Tensor, act_prescale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (times act_prescale) -> (int8 [M, K], fp32 scale [M, 1]): the first half of
    `w8a8_linear_torch`, shared by sibling linears that read the same x."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if act_prescale is not None:
        x2 = x2.float() * act_prescale
    return quantize_per_token_fast(x2)


def linear_from_quantized_torch(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    packed: TorchPackedWeight | None,
    dtype: torch.dtype,
    lead: tuple[int, ...],
) -> torch.Tensor:
    """int8 GEMM + fp32 epilogue of `w8a8_linear_torch`: (a_q [M, K], a_scale [M, 1]) -> [*lead, N] in dtype."""
    acc = int8_matmul_torch(a_q, weight_q, packed)  # int32 [M, N]
    out = acc * a_scale  # int32 * fp32 -> fp32, the same as acc.float() * a_scale
    out.mul_(weight_scale)
    if bias is not None:
        out.add_(bias)  # promoted to fp32 in place, as the reference's `+ bias.float()`
    return out.to(dtype).reshape(*lead, weight_q.shape[0])


def rms_factor_torch(x2: torch.Tensor, eps: float) -> torch.Tensor:
    """[M, K] -> fp32 [M, 1]: 1 / sqrt(mean(x^2) + eps) with torch's own row sum (one row's result
    depends on that row only; its summation order is torch's, not the C kernel's 16 lanes)."""
    from quasar_hf.ops.reference import sqrt_correctly_rounded

    xf = x2.float()
    mean = (xf * xf).sum(dim=-1, keepdim=True) / x2.shape[-1]
    return torch.reciprocal(sqrt_correctly_rounded(mean + eps))


def bind_folded_torch(weights: tuple, packed: object | None):
    """`folded(x, norm_scale, eps)`: W8A8(RMSNorm(x)) with the norm folded into one per-token quantization
    of x * norm_scale, each row's scale times rms_factor_torch (reference.w8a8_linear_rmsnorm_reference
    with torch's row sum); x is one this weight takes (the `quasar::w8a8_folded_norm_linear` op checked it)."""
    weight_q, weight_scale, bias = weights
    own = packed if isinstance(packed, TorchPackedWeight) else None

    def folded(x: torch.Tensor, norm_scale: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        a_q, a_scale = quantize_per_token_fast(x2.float() * norm_scale)
        a_scale = torch.where(a_scale == 0, a_scale, a_scale * rms_factor_torch(x2, eps))
        return linear_from_quantized_torch(a_q, a_scale, weight_q, weight_scale, bias, own, x.dtype, x.shape[:-1])

    return folded
