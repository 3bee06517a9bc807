"""Tiny float verifiers for the speculative loop's tests (vocabulary 256, bos 1, eos 2, pad 0)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from quasar_hf.ops.rowstable_attention import QUASAR_ATTENTION, use_rowstable_attention
from tests.helpers.prompts import SPEC_VOCAB
from tests.helpers.tiny_models import TINY_SHAPE

ARCHS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}


def tiny_verifier(arch="llama", seed=0, vocab=SPEC_VOCAB, attention="sdpa", **overrides):
    """A random 2-layer fp32 model of `arch` (hidden 64, GQA 4/2 heads), switched to `attention`."""
    torch.manual_seed(seed)
    config = ARCHS[arch](
        **TINY_SHAPE,
        num_hidden_layers=2,
        vocab_size=vocab,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **overrides,
    )
    model = AutoModelForCausalLM.from_config(config).float().eval()
    if attention == QUASAR_ATTENTION:
        assert use_rowstable_attention(model)
    return model
