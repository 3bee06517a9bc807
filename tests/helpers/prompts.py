"""Prompts that make n-gram drafts get accepted, and left-padded batches of prompts."""

from __future__ import annotations

import torch

SPEC_VOCAB = 256  # tests.helpers.spec_models' vocabulary


def repeating_prompt(seed: int, length: int = 30) -> torch.Tensor:
    """A prompt that repeats itself, so n-gram drafts are proposed and partly accepted: [1, length]."""
    base = torch.randint(0, 96, (length // 2 + 2,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([base, base])[None, :length]


def repetitive_prompt(seed, length=24, vocab: int = SPEC_VOCAB):
    """Random tokens (ids 3 .. vocab - 1) with a repeated span so the n-gram drafter finds matches: [1, 1.5 length]."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, vocab, (length,), generator=g)
    return torch.cat([base, base[: length // 2]])[None]


def left_padded(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [1, T_i] -> ids, mask [B, max T] (left padding with token `pad`)."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[1] :] = p[0]
        mask[row, width - p.shape[1] :] = 1
    return ids, mask
