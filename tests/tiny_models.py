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
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
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
