"""Prompts that make n-gram drafts get accepted (batches of them: quasar_hf.speculative.left_padding)."""

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
