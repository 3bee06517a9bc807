"""Prompts of different lengths as one batch: right-aligned token ids and their attention mask.

Decoder-only generation pads on the left, so every row's last token sits in the last column and
new tokens append in step. The one helper the request batcher, the benchmarks and the tests use.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_padded(
    prompts: Sequence[Sequence[int] | torch.Tensor], pad: int = 0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both int64 [B, longest prompt]: prompt b's tokens (a list of ids, or a
    tensor [T] or [1, T]) right-aligned in row b after `pad` ids, and 1 where a token is, 0 where padding is."""
    rows = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
    width = max(row.numel() for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - row.numel() :] = row
        mask[b, width - row.numel() :] = 1
    return (ids, mask) if device is None else (ids.to(device), mask.to(device))
