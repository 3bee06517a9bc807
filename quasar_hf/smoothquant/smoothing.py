"""SmoothQuant: compute per-channel factors s and fold them so the float function is unchanged.

    Y = (X diag(s)^-1) (diag(s) W),   s_j = max|X_j|^a / max|W_j|^(1-a)   (Xiao et al., 2023)

1/s goes into the module that produces X (an RMSNorm's weight, or the rows of a linear), s goes
into the columns of the balance linears. When 1/s cannot be folded it is returned as an
activation pre-scale that W8A8Linear applies at run time. `alpha="auto"` picks, per mapping,
the strength on the grid that minimises the fake-quantized output error on sampled
calibration activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quasar_hf.ops.reference import fake_quantize_weight_per_channel_, quantize_per_token
from quasar_hf.smoothquant.mappings import SmoothMapping

MIN_SCALE = 1e-5


@dataclass
class SmoothResult:
    """What smoothing one mapping did: the chosen alpha, and per balance linear an optional pre-scale."""

    alpha: float
    prescale: dict[str, torch.Tensor]  # balance path -> 1/s [K] when it could not be folded


def smoothing_factors(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] = a^alpha / w^(1-alpha); channels never active (a=0) or without weight (w=0) keep s=1."""
    a = act_absmax.float()
    w = weight_absmax.float()
    s = a.clamp_min(MIN_SCALE).pow(alpha) / w.clamp_min(MIN_SCALE).pow(1.0 - alpha)
    keep = (a <= 0) | (w <= 0) | ~torch.isfinite(s)
    return torch.where(keep, torch.ones_like(s), s.clamp_min(MIN_SCALE))


SEARCH_CHUNK_ELEMENTS = 1 << 20  # weight elements fake-quantized per pass (4 MB in fp32: cache-resident)


def _fake_quant_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, refs: list[torch.Tensor]) -> float:
    """Relative squared error of W8A8(x/s, W*s) vs the float product, summed over balance linears.

    Each weight is scaled and fake-quantized a few thousand rows at a time (each row is quantized on
    its own, so the values are those of the whole weight at once): the chunk's passes stay in the
    cache instead of each streaming the whole weight from memory."""
    xq, xs = quantize_per_token(x / s)  # [S, K]
    x_hat = xq.float() * xs
    err = 0.0
    for w, ref in zip(weights, refs):
        rows = max(1, SEARCH_CHUNK_ELEMENTS // w.shape[1])
        buffer = torch.empty(min(rows, w.shape[0]), w.shape[1], device=w.device)  # one chunk's fp32 storage, reused
        squared = x_hat.new_zeros(())
        for start in range(0, w.shape[0], rows):
            chunk = torch.mul(w[start : start + rows], s, out=buffer[: min(rows, w.shape[0] - start)])  # [r, K]
            fake_quantize_weight_per_channel_(chunk)
            squared += (x_hat @ chunk.t() - ref[:, start : start + rows]).pow(2).sum()
        err += (squared / ref.pow(2).sum().clamp_min(1e-12)).item()
    return err


def search_alpha(
    samples: torch.Tensor,
    act_absmax: torch.Tensor,
    weights: list[torch.Tensor],
    grid: list[float],
    reduce=lambda t: t,
    expand=lambda t: t,
) -> float:
    """The alpha on `grid` whose smoothing gives the least fake-quantized output error on `samples` [S, K].

    `reduce`/`expand` tie factors across channel groups exactly as they will be applied (GQA v->o).
    """
    refs = [samples @ w.t() for w in weights]
    w_absmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    errors = []
    for a in grid:
        s = expand(smoothing_factors(reduce(act_absmax), reduce(w_absmax), a))
        errors.append(_fake_quant_error(samples, weights, s, refs))
    return float(grid[min(range(len(grid)), key=errors.__getitem__)])


def _group_reduce(t: torch.Tensor, num_heads: int, num_kv: int, head_dim: int) -> torch.Tensor:
    """[num_heads*head_dim] -> [num_kv*head_dim]: max over the query heads sharing each KV head."""
    group = num_heads // num_kv
    return t.view(num_kv, group, head_dim).amax(dim=1).reshape(-1)


def _group_expand(t: torch.Tensor, num_heads: int, num_kv: int, head_dim: int) -> torch.Tensor:
    """[num_kv*head_dim] -> [num_heads*head_dim]: query head h reads KV head h // group (HF repeat_kv)."""
    group = num_heads // num_kv
    return t.view(num_kv, 1, head_dim).expand(num_kv, group, head_dim).reshape(-1)


@torch.no_grad()
def smooth_mapping(
    layer: nn.Module,
    mapping: SmoothMapping,
    act_absmax: torch.Tensor,
    samples: torch.Tensor | None,
    alpha: float | str,
    grid: list[float],
    float_weights: dict[str, torch.Tensor],
) -> SmoothResult:
    """Smooth one mapping of one decoder layer in place.

    `float_weights` maps balance/smooth linear paths to fp32 copies of their weights; they are
    updated here (the int8 weights are later quantized from these exact fp32 values, not from a
    model-dtype rounding of them). Norm weights are updated in the model itself.
    """
    smooth = layer.get_submodule(mapping.smooth)
    weights = [float_weights[p] for p in mapping.balance]  # each [N_b, K]
    act = act_absmax.float()

    rows = _smooth_rows(layer, mapping, float_weights, weights[0].shape[1])  # the smooth linear's rows read
    grouped = None
    if mapping.kind == "grouped_linear" and rows is not None:
        head_dim = getattr(layer.get_submodule(mapping.smooth.rsplit(".", 1)[0]), "head_dim", None)
        v_out, o_in = rows.stop - rows.start, weights[0].shape[1]
        if head_dim and v_out % head_dim == 0 and o_in % head_dim == 0 and (o_in // head_dim) % (v_out // head_dim) == 0:
            grouped = (o_in // head_dim, v_out // head_dim, head_dim)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return _group_reduce(t, *grouped) if grouped else t

    def expand(t: torch.Tensor) -> torch.Tensor:
        return _group_expand(t, *grouped) if grouped else t

    if alpha == "auto":
        if samples is None or samples.numel() == 0:
            raise ValueError(f"alpha='auto' needs sampled calibration activations for {mapping.balance}")
        chosen = search_alpha(samples, act, weights, grid, reduce, expand)
    else:
        chosen = float(alpha)
    w_absmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)  # [K]
    s = expand(smoothing_factors(reduce(act), reduce(w_absmax), chosen))  # [K]

    for _p, w in zip(mapping.balance, weights):
        w.mul_(s)  # columns *= s
    prescale: dict[str, torch.Tensor] = {}
    foldable = mapping.kind == "norm" or (rows is not None and (mapping.kind == "linear" or grouped is not None))
    if mapping.kind == "norm" and foldable and isinstance(getattr(smooth, "weight", None), torch.Tensor):
        _fold_into_norm(smooth, s, mapping.norm_offset)
    elif mapping.kind in ("linear", "grouped_linear") and foldable and mapping.smooth in float_weights:
        s_rows = reduce(s)  # the factor of each output row of the smooth linear that the balance reads
        float_weights[mapping.smooth][rows].div_(s_rows[:, None])
        if getattr(smooth, "bias", None) is not None:
            smooth.bias[rows] = (smooth.bias[rows].float() / s_rows).to(smooth.bias.dtype)
    else:
        prescale = {p: (1.0 / s) for p in mapping.balance}
    return SmoothResult(alpha=chosen, prescale=prescale)


def _smooth_rows(layer: nn.Module, mapping: SmoothMapping, float_weights: dict, balance_in: int) -> slice | None:
    """Rows of the smooth linear whose outputs the balance linears read (None: cannot tell, do not fold).

    "all": every row. "last": the tail of a fused projection: `balance_in` rows for a linear
    (up inside gate_up_proj), num_key_value_heads * head_dim for grouped v -> o (v inside qkv_proj).
    """
    if mapping.kind == "norm" or mapping.smooth not in float_weights:
        return None
    total = float_weights[mapping.smooth].shape[0]
    if mapping.smooth_rows == "all":
        return slice(0, total)
    count = balance_in
    if mapping.kind == "grouped_linear":
        attention = layer.get_submodule(mapping.smooth.rsplit(".", 1)[0])
        config = getattr(attention, "config", None)
        kv_heads = getattr(attention, "num_key_value_heads", None) or getattr(config, "num_key_value_heads", None)
        head_dim = getattr(attention, "head_dim", None)
        if not kv_heads or not head_dim:
            return None
        count = kv_heads * head_dim
    return slice(total - count, total) if 0 < count <= total else None


def _fold_into_norm(norm: nn.Module, s: torch.Tensor, offset: float = 0.0) -> None:
    """norm output channel j is divided by s_j. The norm multiplies by (offset + weight), so
    weight' = (offset + weight) / s - offset (offset 1 for Gemma's (1 + w) RMSNorm); bias /= s."""
    norm.weight.copy_(((offset + norm.weight.float()) / s - offset).to(norm.weight.dtype))
    if getattr(norm, "bias", None) is not None:
        norm.bias.copy_((norm.bias.float() / s).to(norm.bias.dtype))
