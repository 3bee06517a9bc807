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

from quasar_hf.ops.hadamard import HadamardRotation, rotate_columns_gemm
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
    left = rotate_columns_gemm(hessian, rotation, torch.float32)  # Q^T H
    return rotate_columns_gemm(left.t(), rotation, torch.float32)  # Q^T (Q^T H)^T = Q^T H Q (H symmetric)


def _reversed_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper triangular V with H = V V^T after damping (the Cholesky factor of H with the channel order
    reversed); consumes `h` (edited in place, then dropped).

    GPTQ's factor chol(H^-1) (upper) is V^-1, so its updates can be read off V itself (see
    gptq_round): one Cholesky of K^3 / 3 multiply-adds instead of a Cholesky, an inverse and a second
    Cholesky (4 K^3 / 3). fp32, at most three K x K matrices alive at once, the caller's H included
    (an 8B model's down_proj has K = 14336: 0.8 GB each). Channels never seen get H_kk = 1.
    """
    diagonal = torch.diagonal(h)
    diagonal.masked_fill_(diagonal <= 0, 1.0)
    step = damp * float(diagonal.mean())
    diagonal.add_(step)
    for _ in range(6):  # more damping if H is numerically singular
        factor, info = torch.linalg.cholesky_ex(h.flip(0, 1))  # J H J = L L^T, J the reversal
        if int(info) == 0:
            del h, diagonal
            return factor.flip(0, 1)  # V = J L J: upper, and V V^T = J (J H J) J = H
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
    v = _reversed_cholesky(h, damp)  # [K, K] upper, H = V V^T
    del h
    a = v.div_(torch.diagonal(v).clone()[None, :])  # [K, K] unit upper: a[j, k] = V[j, k] / V[k, k]
    # GPTQ with U = chol(H^-1) = V^-1 quantizes row k of wt (column k of W) after adding
    # sum_{j<k} (w_j - q_j) a[j, k], w_j the original rows: the same values as its error updates
    # (QuIP, Chee et al. 2023, show GPTQ's equivalence to this LDL form). wt's finished rows are
    # overwritten by their errors d_j = w_j - q_j.
    qt = torch.empty_like(wt)
    halves = torch.full_like(scale, 0.5)
    k = wt.shape[0]
    for start in range(0, k, block):
        stop = min(start + block, k)
        current = wt[start:stop].clone()  # [B, N]
        if start > 0:
            current.addmm_(a[:start, start:stop].t(), wt[:start])  # the finished rows' errors
        for j in range(start, stop):
            row = current[j - start]
            torch.addcdiv(halves, row, scale, out=qt[j]).floor_().clamp_(-QMAX, QMAX)  # floor(row / scale + 0.5)
            error = wt[j].sub_(qt[j] * scale)  # d_j = w_j - q_j, kept in wt[j]
            current[j - start + 1 :].addr_(a[j, j + 1 : stop], error)  # spread over this block's later rows
    scale = torch.where(amax > 0, scale, torch.zeros_like(scale))
    return qt.t().contiguous().to(weight.device, torch.int8), scale.to(weight.device, torch.float32)
