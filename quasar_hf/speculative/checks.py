"""Refusals of the speculative loop: inputs it cannot take and generate options it does not implement.

Both raise a clear error naming the option and the fix, never a silent fallback to another
decoding algorithm.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig

# GenerationConfig options that change the decoding algorithm itself: refused, never ignored.
_UNSUPPORTED_OPTIONS = {
    "num_beams": (1, "beam search"),
    "num_return_sequences": (1, "several returned sequences per prompt"),
    "penalty_alpha": (None, "contrastive search"),
    "dola_layers": (None, "DoLa decoding"),
    "prompt_lookup_num_tokens": (None, "Transformers' prompt lookup (use quasar drafter='ngram' instead)"),
    "assistant_early_exit": (None, "Transformers' self-speculative early exit"),
    "output_scores": (False, "output_scores"),
    "output_logits": (False, "output_logits"),
    "output_attentions": (False, "output_attentions"),
    "output_hidden_states": (False, "output_hidden_states"),
    "prefill_chunk_size": (None, "chunked prefill"),
    "token_healing": (False, "token healing"),
}
_SUPPORTED_CACHES = (None, "dynamic", "static")  # "static": the loop's StaticVerifierCache


_SHORT_INT_DTYPES = (torch.int32, torch.int16, torch.int8, torch.uint8)
INPUTS_EMBEDS_HELP = (
    "generate(quasar=...) drafts and verifies token ids, so it needs the prompt as input_ids; inputs_embeds is not "
    "supported. Pass input_ids, or call generate without quasar for a prompt given as embeddings."
)


def as_long_ids(input_ids: Any) -> Any:
    """Token ids in a narrower integer dtype (int32 from some tokenizers and ONNX pipelines) as int64, as
    plain generate takes them; anything else as it is (`_check_inputs` judges it)."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dtype in _SHORT_INT_DTYPES:
        return input_ids.long()
    return input_ids


def _check_inputs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("Quasar speculative generation supports decoder-only causal LMs, not encoder-decoder models.")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise TypeError(
            "input_ids must be a LongTensor of shape [batch, prompt_length] (use tokenizer(..., return_tensors='pt'))."
        )
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: speculative generation needs a prompt of at least one token.")
    _check_token_range(model, input_ids)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}."
            )
        empty_rows = (attention_mask == 0).all(dim=-1).nonzero().flatten().tolist()
        if empty_rows:
            raise ValueError(
                f"Row(s) {empty_rows} of the batch are empty: their attention_mask is all zeros, so they hold no prompt "
                "token. Remove those prompts from the batch, or give each row at least one token."
            )
        if bool((attention_mask[:, -1] == 0).any()):
            raise ValueError(
                "Right padding detected: decoder-only generation needs left padding (tokenizer.padding_side = 'left')."
            )


def _check_token_range(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    """Every id indexes the embedding table (else the embedding lookup fails deep inside the forward)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None or input_ids.numel() == 0:
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= rows:
        bad = low if low < 0 else high
        where = (input_ids == bad).nonzero()[0].tolist()
        raise ValueError(
            f"input_ids holds token id {bad} (row {where[0]}, position {where[1]}), outside this model's vocabulary "
            f"of {rows} ids (0..{rows - 1}). Tokenize with the model's own tokenizer, and use an in-vocabulary "
            "pad_token_id for padding."
        )


def _refuse_unsupported(config: GenerationConfig, model_kwargs: dict) -> None:
    """Clear errors for options the speculative loop does not implement (never a silent fallback)."""
    for name, (neutral, what) in _UNSUPPORTED_OPTIONS.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral:
            raise ValueError(f"quasar speculative generation does not support {what} ({name}={value!r}); remove it.")
    if config.cache_implementation not in _SUPPORTED_CACHES:
        raise ValueError(
            f"quasar speculative generation keeps a dynamic or a static KV cache of its own (it rolls back rejected "
            f"drafts); cache_implementation={config.cache_implementation!r} is not supported: use 'dynamic' or 'static'."
        )
    if config.guidance_scale not in (None, 1, 1.0):
        raise ValueError("quasar speculative generation does not support classifier-free guidance (guidance_scale).")
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in ("use_cache",))
    if extra:
        raise ValueError(
            f"quasar speculative generation does not accept the model inputs {extra}; pass input_ids and attention_mask only."
        )
    if model_kwargs.get("use_cache") is False or config.use_cache is False:
        raise ValueError("quasar speculative generation needs use_cache=True (the KV cache is rolled back on rejection).")
