"""Compiled steps over a static KV cache: a tiny model's verify call against its one-token decode calls."""

from __future__ import annotations

import torch
from transformers import CompileConfig, StaticCache

AOT_EAGER = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager")  # Dynamo's graphs, eager kernels: seconds
PROMPT = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(0))
DRAFTS = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(1))  # a 3-draft verify step
CACHE_LEN = 64


def step(forward, cache: StaticCache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """One forward of ids [1, n] at positions start..start+n-1 over `cache`: logits [1, n, V]."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    return forward(input_ids=ids, position_ids=positions, cache_position=positions[0], past_key_values=cache).logits


def prefilled(model) -> StaticCache:
    cache = StaticCache(config=model.config, max_cache_len=CACHE_LEN)
    step(model.forward, cache, PROMPT.to(model.device), 0)  # eager prefill: only the decode and verify steps are compiled
    return cache


def verify_and_decode_rows(model, compiled) -> tuple[torch.Tensor, torch.Tensor]:
    """(one compiled call over the drafts, one compiled one-token call per draft), both [1, n, V]."""
    start, drafts = PROMPT.shape[1], DRAFTS.to(model.device)
    verify = step(compiled, prefilled(model), drafts, start)
    cache = prefilled(model)
    decode = torch.cat([step(compiled, cache, drafts[:, i : i + 1], start + i) for i in range(drafts.shape[1])], dim=1)
    return verify, decode
