"""What every benchmark variant is: a generate function, and the plain greedy one built on `model.generate`.

The runner, the peers (torchao, llama.cpp) and the GPU check all build variants of this one type,
so they share it here rather than importing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from quasar_hf.detect import plain_decoding

# (prompt ids [1, T], max_new_tokens) -> (the new token ids, per-run stats such as acceptance)
Generate = Callable[[torch.Tensor, int], tuple[list[int], dict]]


def greedy_generate(model: torch.nn.Module, **extra: Any) -> Generate:
    """A variant that calls `model.generate` greedily (extra kwargs select e.g. prompt lookup)."""

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.eos_token_id or 0,
            **{**plain_decoding(model), **extra},
        )
        return out[0, input_ids.shape[1] :].tolist(), {}

    return run
