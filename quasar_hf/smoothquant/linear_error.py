"""Output error of one W8A8 linear against its float original, split by what is quantized.

A smoothed W8A8 linear computes in *effective* coordinates: its input is `x_eff = x / c` and its
float weight is `W_eff = diag(1/r) W diag(c)`, where x and W are the original input and weight,
c [K] is the SmoothQuant column factor (folded into the producer or applied as `act_prescale`)
and r [N] a row factor (present when this linear's output rows were scaled to smooth the next
linear). So `x_eff @ W_eff.T = (x @ W.T) / r`, and every output below is multiplied back by r:
errors are measured in the original output coordinates, independent of the smoothing choice.

Split (quantized with the reference numerics of `quasar_hf.ops.reference`, products in fp64 so
the int8 path is exact and the float path carries no rounding of its own):
  weight: x_eff @ deq(W_q).T        (int8 weights, float activations)
  act:    deq(Q(x_eff)) @ W_eff.T   (per-token int8 activations, float weights)
  both:   deq(Q(x_eff)) @ deq(W_q).T  (W8A8, what the verifier computes; exact int32 products)
"""

from __future__ import annotations

import math

import torch

from quasar_hf.ops.hadamard import HadamardRotation, rotate_rows_float64
from quasar_hf.ops.reference import quantize_per_token, quantize_weight_per_channel

SPLITS = ("weight", "act", "both")


def new_error_sums() -> dict[str, float]:
    """Accumulators: squared error per split, squared reference, rows seen."""
    return {"weight": 0.0, "act": 0.0, "both": 0.0, "reference": 0.0, "rows": 0}


@torch.no_grad()
def add_output_errors(
    sums: dict[str, float],
    x_eff: torch.Tensor,
    w_float: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias_float: torch.Tensor | None = None,
    bias_q: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
) -> dict[str, float]:
    """Add the errors of one batch of rows to `sums` (in place) and return it.

    x_eff [M, K] effective input; w_float [N, K] effective float weight; w_q int8 [N, K] and
    w_scale [N] the quantized weight; bias_float / bias_q [N] the float and deployed biases
    (effective coordinates); row_scale r [N] maps outputs back to original coordinates.
    """
    x32 = x_eff.reshape(-1, x_eff.shape[-1]).float()  # [M, K]
    xq, xs = quantize_per_token(x32)  # int8 [M, K], [M, 1]: exactly what the kernel quantizes
    x, w = x32.double(), w_float.double()  # [M, K], [N, K]
    w_deq = w_q.double() * w_scale.float().double()[:, None]  # [N, K]
    x_deq = xq.double() * xs.double()  # [M, K]
    bf = 0.0 if bias_float is None else bias_float.double()
    bq = bf if bias_q is None else bias_q.double()
    r = 1.0 if row_scale is None else row_scale.double()  # [N]
    reference = (x @ w.t() + bf) * r  # [M, N]
    outputs = {
        "weight": (x @ w_deq.t() + bq) * r,
        "act": (x_deq @ w.t() + bf) * r,
        "both": (x_deq @ w_deq.t() + bq) * r,
    }
    for split, out in outputs.items():
        sums[split] += float((out - reference).pow(2).sum())
    sums["reference"] += float(reference.pow(2).sum())
    sums["rows"] += x.shape[0]
    return sums


def relative_mse(error: float, reference: float) -> float:
    """||y_hat - y||^2 / ||y||^2 (0 for a zero reference with zero error, inf otherwise)."""
    if reference > 0:
        return error / reference
    return 0.0 if error == 0 else math.inf


def sqnr_db(rel_mse: float) -> float:
    """Signal-to-quantization-noise ratio in dB: -10 log10(relative MSE); inf when exact."""
    return math.inf if rel_mse <= 0 else -10.0 * math.log10(rel_mse)


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Relative MSE and SQNR (dB) per split from accumulated sums."""
    out: dict[str, float] = {"rows": int(sums["rows"])}
    for split in SPLITS:
        rel = relative_mse(sums[split], sums["reference"])
        out[f"{split}_rel_mse"] = rel
        out[f"{split}_sqnr_db"] = sqnr_db(rel)
    return out


FACTOR_SUBSET = 256


def _spread(size: int, count: int) -> torch.Tensor:
    """At most `count` indices spread evenly over range(size)."""
    return torch.linspace(0, size - 1, min(size, count)).round().long().unique()


def _log_ratio(original: torch.Tensor, smoothed: torch.Tensor) -> torch.Tensor:
    w = original.double()
    ratio = smoothed.double() / w
    valid = (w != 0) & torch.isfinite(ratio) & (ratio > 0)
    return torch.where(valid, ratio.abs().log(), torch.full_like(ratio, math.nan))


@torch.no_grad()
def column_row_factors(original: torch.Tensor, smoothed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c [K], r [N]) with `smoothed = diag(1/r) original diag(c)`, up to one common constant.

    Smoothing only scales columns (and, for a linear that feeds another, rows) of a weight, so
    the elementwise ratio smoothed / original is rank one; this recovers it from the entries where
    the original is nonzero (medians in the log domain: exact for exact data, robust to zeros).
    """
    if original.shape != smoothed.shape or original.dim() != 2:
        raise ValueError(f"expected two weights of one shape [N, K]; got {tuple(original.shape)} and {tuple(smoothed.shape)}")
    n, k = original.shape
    device = original.device
    rows = _spread(n, FACTOR_SUBSET).to(device)  # a few hundred rows / columns pin every factor: the ratio is exact
    cols = _spread(k, FACTOR_SUBSET).to(device)
    by_row = _log_ratio(original[rows], smoothed[rows])  # [n', K] log c_k - log r_n (nan where undefined)
    by_col = _log_ratio(original[:, cols], smoothed[:, cols])  # [N, k']
    log_r = torch.zeros(n, dtype=torch.float64, device=device)
    log_c = torch.zeros(k, dtype=torch.float64, device=device)
    for _ in range(3):
        log_c = torch.nanmedian(by_row + log_r[rows, None], dim=0).values.nan_to_num(0.0)
        log_r = torch.nanmedian(log_c[None, cols] - by_col, dim=1).values.nan_to_num(0.0)
    shift = log_r.median()  # a common constant cancels; keep r near 1
    return (log_c - shift).exp().float(), (log_r - shift).exp().float()


@torch.no_grad()
def calibration_error(
    samples: torch.Tensor,
    original_weight: torch.Tensor,
    smoothed_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    rotation: HadamardRotation | None = None,
) -> dict[str, float]:
    """Error split of one linear on sampled calibration rows, as quantization sees them.

    samples [S, K]: the linear's original (unsmoothed) inputs; original_weight [N, K]: its float
    weight before smoothing; smoothed_weight [N, K]: the fp32 weight that will be quantized
    (columns times c, rows divided by r); bias: the deployed (smoothed) bias [N]; rotation: the
    Hadamard rotation a RotatedW8A8Linear applies to its input (and to the weight it quantizes).
    """
    c, r = column_row_factors(original_weight, smoothed_weight)
    x, weight = samples.float() / c, smoothed_weight
    if rotation is not None:
        x, weight = rotate_rows_float64(x, rotation).float(), rotate_rows_float64(weight, rotation).float()
    w_q, w_scale = quantize_weight_per_channel(weight)
    sums = add_output_errors(new_error_sums(), x, weight, w_q, w_scale, bias, bias, r)
    return summarize(sums)
