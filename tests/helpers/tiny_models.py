"""Tiny random models and a character-level tokenizer for fast, offline tests."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

# The dimensions every tiny test model shares: hidden 64, MLP 128, GQA 4 heads over 2 KV heads.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
CONFIG_CLASSES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Printable ASCII as ids 0..94, then <unk>=95, </s>=96 (vocab fits in 128)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {chr(i): i - 32 for i in range(32, 127)}
    vocab.update({"<unk>": 95, "</s>": 96})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="</s>")


def tiny_model(arch: str = "llama", seed: int = 0, layers: int = 2, dtype=torch.float32):
    """A random decoder-only LM: hidden 64, GQA 4 heads / 2 KV heads, vocab 128."""
    config = CONFIG_CLASSES[arch](
        **TINY_SHAPE,
        num_hidden_layers=layers,
        vocab_size=128,
        max_position_embeddings=512,
        eos_token_id=96,
        pad_token_id=96,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def save_tiny(path, arch: str = "llama", seed: int = 0, dtype=torch.float32) -> str:
    """Save a tiny model + tokenizer to `path` (safetensors) and return the folder."""
    model = tiny_model(arch, seed, dtype=dtype)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


def assert_quasar_greedy_equals_plain(model, max_new_tokens: int) -> None:
    """On a prompt that repeats itself (so n-gram drafts get accepted): greedy quasar=True == plain greedy."""
    base = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(1))
    prompt = torch.cat([base, base[:10]])[None]
    plain = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, quasar=False)
    spec = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, quasar=True, return_dict_in_generate=True)
    assert spec.quasar_stats.verify_steps > 0
    assert torch.equal(spec.sequences, plain)


def recording_aot_eager(seen: list[str]):
    """A torch.compile backend that appends every traced call's target to `seen`, then runs the
    graph through AOTAutograd with eager kernels (so the bits are eager's)."""

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    return backend


def outlier_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model whose norms and producer rows have outlier channels, so smoothing factors are far from 1."""
    model = tiny_model(arch, seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[[3, 17]] *= 25.0
            layer.post_attention_layernorm.weight[5] *= 25.0
            layer.self_attn.v_proj.weight[7] *= 10.0
            layer.mlp.up_proj.weight[[2, 40]] *= 10.0
    return model


def save_outlier(path, arch: str, seed: int = 0) -> str:
    outlier_model(arch, seed).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


def quasar_model(tmp_path, arch: str, dtype: torch.dtype = torch.float32, with_source: bool = False, device_map=None):
    """A tiny W8A8 model of `arch`, quantized where `device_map` puts it (and, with_source, its float original:
    an assistant that agrees often)."""
    from quasar_hf import QuasarConfig
    from tests.helpers.tiny_archs import save_tiny_arch  # it builds on this module

    src = save_tiny_arch(tmp_path / arch, arch) if arch in ("gemma3", "phi3") else save_tiny(tmp_path / arch, arch)
    config = QuasarConfig(num_calibration_samples=4, calibration_seq_len=64, weight_rounding="nearest", alpha=0.5)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=dtype, device_map=device_map).eval()
    if not with_source:
        return model
    return model, AutoModelForCausalLM.from_pretrained(src, dtype=dtype, device_map=device_map).eval()


def tiny_logits() -> torch.Tensor:
    """Logits of a tiny bf16 Llama with W8A8 linears, norm-folded groups, rotation, row-stable attention and lm_head."""
    from quasar_hf.hf.fusion import fuse_projections
    from quasar_hf.hf.quantize_on_load import use_rowstable_lm_head, use_rowstable_norms
    from quasar_hf.nn import RotatedW8A8Linear, W8A8Linear
    from quasar_hf.nn.w8a8_linear import rotate_weight
    from quasar_hf.ops.hadamard import HadamardRotation
    from quasar_hf.ops.rowstable_attention import use_rowstable_attention

    model = tiny_model("llama", dtype=torch.bfloat16)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and name == "down_proj":
                rotation = HadamardRotation.for_size(child.in_features)
                setattr(module, name, RotatedW8A8Linear.from_weight(rotate_weight(child.weight.float(), rotation)))
            elif isinstance(child, torch.nn.Linear) and name != "lm_head":
                setattr(module, name, W8A8Linear.from_linear(child))
    fuse_projections(model)
    use_rowstable_norms(model)
    use_rowstable_lm_head(model)
    use_rowstable_attention(model)
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids).logits
