"""alpha search against the error of the whole decoder layer's output (`QuasarConfig(alpha_search="layer")`).

The per-linear search (`smoothing.search_alpha`) scores each alpha by the fake-quantized error of
the mapping's own linears. What the model feels is the decoder layer's output: q/k errors pass
through softmax, v/o and gate/up/down errors add up in the residual stream. Here each mapping's
alpha is chosen, in mapping order, by running the layer with W8A8 copies of every linear smoothed
so far (earlier mappings at their chosen alphas, this one at the candidate) and measuring

    mean over tokens t of ||y_q[t] - y[t]||^2 / ||y[t]||^2

against the float layer's output y on a few calibration blocks. The next layer reads RMSNorm(y),
which divides each token by its own norm, so a per-token relative error is what reaches it; a
plain MSE would be dominated by the few tokens with massive activations.

The search only tries: the layer, its norms, biases and `float_weights` are as they were on exit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quasar_hf.nn import W8A8Linear
from quasar_hf.smoothquant.mappings import SmoothMapping
from quasar_hf.smoothquant.smoothing import smooth_mapping

# run(layer) -> one output [1, T, H] per block, in the order of the reference outputs
RunBlocks = Callable[[nn.Module], list[torch.Tensor]]


def per_token_relative_error(outputs: list[torch.Tensor], references: list[torch.Tensor]) -> float:
    """mean_t ||y_q[t] - y[t]||^2 / ||y[t]||^2 over all tokens of all blocks ([1, T, H] each)."""
    total, count = 0.0, 0
    for out, ref in zip(outputs, references):
        y, r = out.float().reshape(-1, out.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
        err = (y - r).pow(2).sum(-1) / r.pow(2).sum(-1).clamp_min(1e-12)  # [T]
        total += float(err.sum())
        count += err.numel()
    return total / max(count, 1)


def _mutable_state(layer: nn.Module, mappings: list[SmoothMapping]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, copy) for every norm weight/bias and smooth-linear bias that smoothing edits in place."""
    saved = []
    for m in mappings:
        module = layer.get_submodule(m.smooth)
        for attr in ("weight", "bias") if m.kind == "norm" else ("bias",):
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor):
                saved.append((t, t.detach().clone()))
    return saved


def _restore(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for tensor, copy in saved:
            tensor.copy_(copy)


def _set(layer: nn.Module, path: str, module: nn.Module) -> nn.Module:
    old = layer.get_submodule(path)
    layer.set_submodule(path, module)
    return old


def _error_with_w8a8(
    layer: nn.Module,
    weights: dict[str, torch.Tensor],
    prescales: dict[str, torch.Tensor],
    paths: list[str],
    run: RunBlocks,
    references: list[torch.Tensor],
    backend: str,
) -> float:
    """Layer output error with `paths` swapped for W8A8 copies of `weights` (then swapped back)."""
    originals = {}
    try:
        for p in paths:
            linear = layer.get_submodule(p)
            originals[p] = linear
            _set(layer, p, W8A8Linear.from_weight(weights[p], linear.bias, prescales.get(p), backend=backend))
        return per_token_relative_error(run(layer), references)
    finally:
        for p, linear in originals.items():
            _set(layer, p, linear)


@torch.no_grad()
def search_alphas_on_layer_output(
    layer: nn.Module,
    mappings: list[SmoothMapping],
    stats_for: Callable[[SmoothMapping], tuple[torch.Tensor, torch.Tensor | None]],
    float_weights: dict[str, torch.Tensor],
    grid: list[float],
    run: RunBlocks,
    references: list[torch.Tensor],
    backend: str = "auto",
) -> tuple[dict[str, float], dict[str, float]]:
    """Per mapping (keyed by its smooth path), the grid alpha with the least layer output error.

    `stats_for(mapping)` gives (act_absmax [K], sampled rows [S, K]) of the mapping's input;
    `float_weights` maps each quantized linear path to its fp32 weight [N, K] (left unchanged).
    Returns (alphas, the error reached after each mapping: what the layer loses with it quantized).
    """
    saved = _mutable_state(layer, mappings)
    work = {p: w.clone() for p, w in float_weights.items()}  # smoothed as mappings are chosen
    prescales: dict[str, torch.Tensor] = {}
    done: list[str] = []  # linears already smoothed (and so quantized in every later trial)
    alphas, errors = {}, {}
    try:
        for m in mappings:
            absmax, samples = stats_for(m)
            touched = list(m.balance) + ([m.smooth] if m.smooth in work else [])
            paths = list(dict.fromkeys(done + touched))
            trials = {}
            for a in grid:
                trial = {**work, **{p: work[p].clone() for p in touched}}
                before = _mutable_state(layer, [m])
                result = smooth_mapping(layer, m, absmax, samples, float(a), grid, trial)
                trials[float(a)] = _error_with_w8a8(
                    layer, trial, {**prescales, **result.prescale}, paths, run, references, backend
                )
                _restore(before)
            best = min(trials, key=lambda a: (trials[a], abs(a - 0.5)))
            result = smooth_mapping(layer, m, absmax, samples, best, grid, work)  # commit on the working copies
            prescales.update(result.prescale)
            done = paths
            alphas[m.smooth], errors[m.smooth] = best, trials[best]
    finally:
        _restore(saved)
    return alphas, errors
