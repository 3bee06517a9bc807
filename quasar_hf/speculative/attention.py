"""Shape-stable verification: each verified query row gets the attention call a decode step makes.

Why: SDPA with q_len = k+1 uses another kernel path than decode's q_len = 1, so its outputs
differ in the last bits. In a W8A8 model such a difference can flip the INT8 rounding of a
per-token activation, and the flipped K/V of one position then shifts every later logit
(measured on SmolLM2-135M W8A8: up to 2 logits in bf16). The INT8 GEMMs (per-token scales,
exact int32 accumulation), norms, rotary and MLP are row-independent already; attention was
the one shape-dependent op that feeds the KV cache. Inside `rowwise_verification(model)` a
multi-token forward over a non-empty cache runs SDPA once per query row, on exactly the keys
that a one-token decode step would see, so the KV cache and hidden states are bit-identical to
plain decoding. The lm_head GEMM stays batched (its M-dependent rounding reaches only the
logits, never the cache: the source of the near-ties the bf16 tests allow).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ROWWISE_SDPA = "quasar_rowwise_sdpa"


def rowwise_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA with query [B, H, q, D] split into q one-row calls when verifying over a cache."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or q_len == kv_len:  # decode step or prefill: exactly plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for i in range(q_len):
        visible = kv_len - q_len + 1 + i  # keys a decode step at this position would see
        row_mask = None if attention_mask is None else attention_mask[:, :, i : i + 1, :visible]
        if row_mask is not None and row_mask.dtype == torch.bool and bool(row_mask.all()):
            row_mask = None  # plain decode drops an all-visible mask too
        out, _ = sdpa_attention_forward(
            module, query[:, :, i : i + 1], key[:, :, :visible], value[:, :, :visible], row_mask, **kwargs
        )
        outputs.append(out)  # [B, 1, H, D]
    return torch.cat(outputs, dim=1), None


def _register() -> None:
    """Register the attention and its mask builder (the SDPA one) under ROWWISE_SDPA; idempotent."""
    if ROWWISE_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(ROWWISE_SDPA, rowwise_sdpa_attention)
    if ROWWISE_SDPA not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(ROWWISE_SDPA, sdpa_mask)


@contextlib.contextmanager
def rowwise_verification(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, an SDPA model verifies row by row; other attention implementations are left as they are."""
    config = model.config
    if not enabled or config._attn_implementation != "sdpa":
        yield
        return
    _register()
    config._attn_implementation = ROWWISE_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
