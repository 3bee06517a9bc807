"""Tiny random Gemma 3 and Phi-3 models (the architectures beyond tests.helpers.tiny_models' Llama family).

Gemma 3: (1 + w) RMSNorms, pre/post-feedforward norms, q/k norms, sliding + global attention
layers. Phi-3: fused qkv_proj and gate_up_proj.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Phi3Config

from tests.helpers.tiny_models import TINY_SHAPE, char_tokenizer

WINDOW = 8

COMMON = dict(
    **TINY_SHAPE,
    vocab_size=128,
    max_position_embeddings=512,
    eos_token_id=96,
    pad_token_id=96,
)


def tiny_gemma3(seed: int = 0, layers: int = 2, window: int = WINDOW) -> torch.nn.Module:
    """Layer 0 slides over `window` keys, layer 1 is global; norm weights random (not Gemma's zeros)."""
    config = Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=layers,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        bos_token_id=None,
    )
    return _randomize_norms(_build(config, seed), seed)


def tiny_phi3(seed: int = 0, layers: int = 2) -> torch.nn.Module:
    config = Phi3Config(**COMMON, num_hidden_layers=layers, original_max_position_embeddings=512, bos_token_id=None)
    return _randomize_norms(_build(config, seed), seed)


def _build(config, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).float().eval()


@torch.no_grad()
def _randomize_norms(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(param + 0.3 * torch.randn(param.shape, generator=gen))
    return model


TINY = {"gemma3": tiny_gemma3, "phi3": tiny_phi3}


def save_tiny_arch(path, arch: str, dtype=torch.float32) -> str:
    TINY[arch]().to(dtype).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


def four_layer_gemma3() -> torch.nn.Module:
    """Sliding-window and global layers alternate: each layer type gets its own mask and rotary embeddings."""
    config = Gemma3TextConfig(
        **TINY_SHAPE,
        num_hidden_layers=4,
        head_dim=16,
        vocab_size=128,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def token_blocks(n: int = 3, t: int = 40) -> torch.Tensor:
    """`n` random rows of `t` printable-ASCII token ids (a fixed seed): calibration blocks."""
    return torch.randint(0, 96, (n, t), generator=torch.Generator().manual_seed(5))
