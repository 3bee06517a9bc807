"""Calibration: run the float model over token blocks and record what each linear sees.

For every linear that will be quantized we keep the per-input-channel abs-max of its input
(SmoothQuant's statistic) and a fixed-size random sample of input rows (for the alpha search).
Hooks are always removed, even when a forward fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm


@dataclass
class LinearInputStats:
    """Statistics of one linear's input: abs-max per channel [K] and sampled rows [S, K] (fp32)."""

    absmax: torch.Tensor
    samples: torch.Tensor
    tokens_seen: int = 0


@dataclass
class CalibrationStats:
    by_module: dict[str, LinearInputStats] = field(default_factory=dict)
    num_blocks: int = 0
    seq_len: int = 0


def _make_hook(name: str, stats: CalibrationStats, rows_per_block: int, generator: torch.Generator):
    def hook(module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        x = args[0] if args else kwargs["input"]
        x2 = x.detach().reshape(-1, x.shape[-1]).float()  # [T, K]
        amax = x2.abs().amax(dim=0)  # [K]
        pick = torch.randperm(x2.shape[0], generator=generator)[:rows_per_block]
        sample = x2[pick.to(x2.device)].cpu()
        entry = stats.by_module.get(name)
        if entry is None:
            stats.by_module[name] = LinearInputStats(amax.cpu(), sample, x2.shape[0])
        else:
            torch.maximum(entry.absmax, amax.cpu(), out=entry.absmax)
            entry.samples = torch.cat([entry.samples, sample])
            entry.tokens_seen += x2.shape[0]

    return hook


@torch.no_grad()
def collect_linear_input_stats(
    model: nn.Module,
    blocks: torch.Tensor,
    module_names: list[str],
    max_sample_rows: int = 512,
    seed: int = 0,
    progress: bool = True,
) -> CalibrationStats:
    """Forward each block [N, T] through `model` and record stats for the named linears."""
    if blocks.dim() != 2 or blocks.shape[0] == 0:
        raise ValueError(f"calibration blocks must be a non-empty [num_blocks, seq_len] tensor, got {tuple(blocks.shape)}")
    stats = CalibrationStats(num_blocks=blocks.shape[0], seq_len=blocks.shape[1])
    rows_per_block = max(1, max_sample_rows // blocks.shape[0])
    generator = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    handles = []
    try:
        for name in module_names:
            module = model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(_make_hook(name, stats, rows_per_block, generator)))
        for block in tqdm(blocks, desc="Quasar calibration", disable=not progress, unit="block"):
            model(input_ids=block[None].to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return stats
