"""Second-order (GPTQ) rounding of int8 weights: `QuasarConfig(weight_rounding="gptq")`.

Rounding each weight to the nearest int8 step ignores that a linear's input channels are
correlated. GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers") quantizes the columns of W one at a time and spreads each column's
rounding error over the columns not yet quantized, weighted by the inverse of the input Hessian
H = sum_t x_t x_t^T, so the output error ||(W - W_q) X||^2 on the calibration inputs drops.
The per-row scales stay max|W[n, :]| / 127, exactly as with nearest rounding, so the kernels,
the checkpoint format and the activation quantization do not change: only which int8 values
the rows hold.
"""

from __future__ import annotations

import torch

from quasar_hf.ops.hadamard import HadamardRotation, rotate_rows_gemm
from quasar_hf.ops.reference import QMAX

GPTQ_BLOCK = 128
GPTQ_DAMP = 0.01  # fraction of the mean diagonal added to H (the paper's default)


def smoothed_hessian(hessian: torch.Tensor, column_factor: torch.Tensor) -> torch.Tensor:
    """H [K, K] of the original inputs x -> H of the inputs a smoothed linear sees, x / c (fp32, one new tensor)."""
    inv = 1.0 / column_factor.to(hessian.device, torch.float32)
    return hessian.float().mul(inv[:, None]).mul_(inv[None, :])


def rotated_hessian(hessian: torch.Tensor, rotation: HadamardRotation) -> torch.Tensor:
    """H [K, K] of inputs x -> H of the rotated inputs x Q: Q^T H Q, fp32.

    fp32 matrix products: their error (~1e-6 of sqrt(H_ii H_jj)) is below the fp32 sums H already
    carries, and far below GPTQ's damping (GPTQ_DAMP of the mean diagonal)."""
    half = rotate_rows_gemm(hessian, rotation, torch.float32)  # H Q
    return rotate_rows_gemm(half.transpose(0, 1), rotation, torch.float32)  # (H Q)^T Q = Q^T H Q (H symmetric)


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of H^-1 after damping; consumes `h` (edited in place, then dropped).

    fp32 and at most two K x K matrices alive at once (an 8B model's down_proj has K = 14336:
    0.8 GB each). Channels never seen get H_kk = 1.
    """
    diagonal = torch.diagonal(h)
    diagonal.masked_fill_(diagonal <= 0, 1.0)
    step = damp * float(diagonal.mean())
    diagonal.add_(step)
    for _ in range(6):  # more damping if H is numerically singular
        factor, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            del h, diagonal
            inverse = torch.cholesky_inverse(factor)
            del factor
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper
            raise ValueError("GPTQ: the inverse of the calibration input Hessian is not positive definite")
        del factor
        diagonal.add_(step * 9.0)  # 10x the damping so far, then 100x, ...
        step *= 10.0
    raise ValueError("GPTQ: the calibration input Hessian is not positive definite even after damping")


@torch.no_grad()
def gptq_round(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    block: int = GPTQ_BLOCK,
    damp: float = GPTQ_DAMP,
    consume: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float, hessian [K, K] of its inputs -> (int8 [N, K], fp32 scale [N] = max|W[n]| / 127).

    `consume=True` lets an fp32 `hessian` be overwritten instead of copied (one K x K matrix less).
    Runs where the Hessian lives (it is summed on the calibration device); results land on the weight's.
    """
    if weight.dim() != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(f"GPTQ needs weight [N, K] and hessian [K, K]; got {tuple(weight.shape)} and {tuple(hessian.shape)}")
    wt = weight.detach().to(hessian.device, torch.float32).t().contiguous()  # [K, N]: column j of W is row j here
    amax = wt.abs().amax(dim=0)  # [N]
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))  # [N]
    h = hessian if consume and hessian.dtype == torch.float32 else hessian.float().clone()
    u = _inverse_cholesky(h, damp)  # [K, K] upper
    del h
    qt = torch.empty_like(wt)
    k = wt.shape[0]
    for start in range(0, k, block):
        stop = min(start + block, k)
        errors = wt.new_empty(stop - start, wt.shape[1])  # [B, N]
        for j in range(start, stop):
            row = wt[j]
            torch.floor(row / scale + 0.5, out=qt[j]).clamp_(-QMAX, QMAX)
            err = errors[j - start]
            torch.sub(row, qt[j] * scale, out=err).div_(u[j, j])  # [N]
            wt[j + 1 : stop].addr_(u[j, j + 1 : stop], err, alpha=-1.0)  # spread over this block's later columns
        if stop < k:
            wt[stop:].addmm_(u[start:stop, stop:].t(), errors, alpha=-1.0)  # and over all later columns
    scale = torch.where(amax > 0, scale, torch.zeros_like(scale))
    return qt.t().contiguous().to(weight.device, torch.int8), scale.to(weight.device, torch.float32)
