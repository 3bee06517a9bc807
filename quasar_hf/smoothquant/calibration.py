"""Calibration: record what each linear sees, for the whole model or one decoder layer at a time.

For every linear that will be quantized we keep the per-input-channel abs-max of its input
(SmoothQuant's statistic) and a fixed-size random sample of input rows (for the alpha search).
`capture_layer_inputs` records what the model hands its decoder layers (layer 0's hidden states,
every layer's keyword arguments: masks, position embeddings, ...) without running any layer, so
layers can then be calibrated one at a time. Hooks and bindings are always removed, even when a
forward fails.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from quasar_hf import compat
from quasar_hf.smoothquant.placement import to_compute


@dataclass
class LinearInputStats:
    """Statistics of one linear's input: abs-max per channel [K], sampled rows [S, K] (fp32), and,
    when asked for (GPTQ rounding), the input Hessian sum_t x_t x_t^T [K, K] (fp32). Linears that
    read the same input (q/k/v, gate/up) share one Hessian: the first of them to run holds it and
    the others name it in `hessian_owner`."""

    absmax: torch.Tensor
    samples: torch.Tensor
    tokens_seen: int = 0
    hessian: torch.Tensor | None = None
    hessian_owner: str | None = None


@dataclass
class CalibrationStats:
    by_module: dict[str, LinearInputStats] = field(default_factory=dict)
    num_blocks: int = 0
    seq_len: int = 0


GRAM_TILE = 512  # columns per row of tiles when summing x^T x (upper_gram_add)


def upper_gram_add(accumulator: torch.Tensor, x: torch.Tensor) -> None:
    """accumulator [K, K] += the tiles of x^T x on or above the diagonal (x [T, K] fp32).

    x^T x is symmetric, so each row of GRAM_TILE-wide tiles is one GEMM from its diagonal tile to the
    right edge: about half the multiply-adds of the full product, and summed in place (no [K, K]
    temporary per call). `mirrored` fills the lower triangle once, after the last call."""
    k = x.shape[1]
    for start in range(0, k, GRAM_TILE):
        stop = min(start + GRAM_TILE, k)
        accumulator[start:stop, start:].addmm_(x[:, start:stop].t(), x[:, start:])


def mirrored(upper: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix whose upper triangle `upper` holds (upper_gram_add's sums), in place."""
    below = torch.triu(upper, diagonal=1).t()
    return upper.triu_().add_(below)


def _make_hook(
    name: str,
    stats: CalibrationStats,
    rows_per_block: int,
    generator: torch.Generator,
    shared: dict,
    gram_sums: dict[str, torch.Tensor] | None = None,
):
    """Forward pre-hook adding one linear's input to `stats`. Siblings reading the same tensor (q/k/v,
    gate/up) share its fp32 copy and abs-max through `shared` (a dict common to the hooks of one
    recording; the first sibling to run fills it). With `gram_sums` it also sums x^T x into it
    (upper tiles, upper_gram_add), computed and held once per input by that first sibling, its owner."""

    def hook(module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        x = args[0] if args else kwargs["input"]
        if shared.get("x") is not x or shared.get("version") != x._version:  # holding x: its id cannot be reused
            x2 = x.detach().reshape(-1, x.shape[-1]).float()  # [T, K]
            shared.update(x=x, version=x._version, owner=name, x2=x2, amax=x2.abs().amax(dim=0))  # amax [K]
            if gram_sums is not None:
                if name not in gram_sums:
                    gram_sums[name] = torch.zeros(x2.shape[1], x2.shape[1], device=x2.device)  # summed where x lives
                upper_gram_add(gram_sums[name], x2)
        x2, amax = shared["x2"], shared["amax"]
        owner = shared["owner"] if gram_sums is not None else None
        pick = torch.randperm(x2.shape[0], generator=generator)[:rows_per_block]
        sample = x2[pick.to(x2.device)].cpu()
        entry = stats.by_module.get(name)
        if entry is None:
            absmax = amax.to("cpu", copy=True)  # its own tensor: updated in place below
            stats.by_module[name] = LinearInputStats(absmax, sample, x2.shape[0], None, None if owner == name else owner)
        else:
            torch.maximum(entry.absmax, amax.cpu(), out=entry.absmax)
            entry.samples = torch.cat([entry.samples, sample])
            entry.tokens_seen += x2.shape[0]

    return hook


@contextmanager
def recording_linear_inputs(
    root: nn.Module,
    module_names: list[str],
    stats: CalibrationStats,
    rows_per_block: int,
    generator: torch.Generator,
    hessians: bool = False,
) -> Iterator[None]:
    """While open, every forward through `root` adds the named linears' inputs to `stats` (keyed by
    those names); `hessians=True` also sums each input's x^T x (for GPTQ rounding), added to the
    owner's `hessian` when the recording closes."""
    handles = []
    shared: dict = {}  # the last input seen and what siblings share of it
    gram_sums: dict[str, torch.Tensor] = {}  # owner name -> upper tiles of its x^T x, this recording
    try:
        for name in module_names:
            module = root.get_submodule(name)
            hook = _make_hook(name, stats, rows_per_block, generator, shared, gram_sums if hessians else None)
            handles.append(module.register_forward_pre_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()
        shared.clear()
        for name in list(gram_sums):
            hessian, entry = mirrored(gram_sums.pop(name)), stats.by_module[name]
            entry.hessian = hessian if entry.hessian is None else entry.hessian.add_(hessian)


def _check_blocks(blocks: torch.Tensor) -> None:
    if blocks.dim() != 2 or blocks.shape[0] == 0:
        raise ValueError(f"calibration blocks must be a non-empty [num_blocks, seq_len] tensor, got {tuple(blocks.shape)}")


@torch.no_grad()
def collect_linear_input_stats(
    model: nn.Module,
    blocks: torch.Tensor,
    module_names: list[str],
    max_sample_rows: int = 512,
    seed: int = 0,
    progress: bool = True,
) -> CalibrationStats:
    """Forward each block [N, T] through the whole `model` and record stats for the named linears."""
    _check_blocks(blocks)
    stats = CalibrationStats(num_blocks=blocks.shape[0], seq_len=blocks.shape[1])
    rows_per_block = max(1, max_sample_rows // blocks.shape[0])
    generator = torch.Generator().manual_seed(seed)
    device = compat.input_device(model)
    with recording_linear_inputs(model, module_names, stats, rows_per_block, generator):
        for block in tqdm(blocks, desc="Quasar calibration", disable=not progress, unit="block"):
            model(input_ids=block[None].to(device), use_cache=False)
    return stats


# ---------------------------------------------------------------- one decoder layer at a time
class _StopForward(Exception):
    """Raised by the last bypassed layer: everything after the decoder layers is not needed."""


@dataclass
class LayerCall:
    """How the model called one decoder layer, less the hidden states: extra positional args and kwargs."""

    args: tuple
    kwargs: dict[str, Any]


@dataclass
class LayerInputs:
    """Per block: layer 0's hidden states [1, T, H], and per layer the rest of its call."""

    hidden: list[torch.Tensor]
    calls: list[list[LayerCall]]  # [block][layer]


def _bypass(calls: list[LayerCall | None], index: int, last: bool, first_hidden: list[torch.Tensor]):
    """A forward for decoder layer `index` that records its call and returns the hidden states unchanged."""

    def forward(*args, **kwargs):
        if args:
            hidden, rest = args[0], tuple(args[1:])
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        calls[index] = LayerCall(rest, dict(kwargs))
        if index == 0:
            first_hidden.append(hidden.detach())
        if last:
            raise _StopForward
        return hidden

    return forward


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, layers: nn.ModuleList, blocks: torch.Tensor, progress: bool = True) -> LayerInputs:
    """Run each block [N, T] through `model` with every decoder layer bypassed (no layer computes).

    Each layer's `forward` is bound on the instance to a recorder for the duration (restored after),
    so per-layer arguments (sliding-window vs global masks and rotary embeddings, any extra kwargs
    a model passes) are captured exactly as the model builds them. The forward stops after the
    last layer: the final norm and lm_head never run.
    """
    _check_blocks(blocks)
    device = compat.input_device(model)
    saved = [layer.__dict__.get("forward") for layer in layers]  # accelerate hooks bind a forward too
    hidden: list[torch.Tensor] = []
    all_calls: list[list[LayerCall]] = []
    try:
        for block in tqdm(blocks, desc="Quasar capturing layer inputs", disable=not progress, unit="block"):
            calls: list[LayerCall | None] = [None] * len(layers)
            for index, layer in enumerate(layers):
                layer.forward = _bypass(calls, index, index == len(layers) - 1, hidden)
            try:
                model(input_ids=block[None].to(device), use_cache=False)
            except _StopForward:
                pass
            if any(call is None for call in calls):
                missing = [i for i, call in enumerate(calls) if call is None]
                raise ValueError(
                    f"{type(model).__name__}'s forward did not call decoder layers {missing}; "
                    "layer-by-layer calibration needs every layer called once per forward"
                )
            all_calls.append(calls)
    finally:
        for layer, forward in zip(layers, saved):
            del layer.forward
            if forward is not None:
                layer.forward = forward
    return LayerInputs(hidden=hidden, calls=all_calls)


def run_layer(layer: nn.Module, hidden: torch.Tensor, call: LayerCall, device: torch.device) -> torch.Tensor:
    """One decoder layer on one block's hidden states [1, T, H], called as the model called it, its inputs
    moved to `device` (the layer's compute device: placement.py)."""
    out = layer(hidden.to(device), *to_compute(call.args, device), **to_compute(call.kwargs, device))
    return out[0] if isinstance(out, (tuple, list)) else out
