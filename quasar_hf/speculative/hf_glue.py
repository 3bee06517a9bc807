"""The ONE place that calls private Transformers generation API (5.17 - 5.24).

`prepare_generation` reproduces the preparation steps of `GenerationMixin.generate` (merged
GenerationConfig, special tokens, attention mask, max_length from max_new_tokens, the logits
processors and stopping criteria plain generate would build), so that the speculative loop
applies exactly the same processors and criteria. If a Transformers upgrade moves these
private methods, only this file changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

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
_SUPPORTED_CACHES = (None, "dynamic")


@dataclass
class PreparedGeneration:
    """Everything the loop needs, prepared the way plain `generate` prepares it."""

    input_ids: torch.Tensor  # [B, T] left-padded prompts
    attention_mask: torch.Tensor  # [B, T] long, 1 = real token
    generation_config: GenerationConfig
    logits_processor: LogitsProcessorList  # for the whole batch [B, ...]
    row_logits_processors: list[LogitsProcessorList]  # one per row, for calls on a single row [1, ...]
    stopping_criteria: StoppingCriteriaList
    pad_token_id: int | None
    max_length: int


def prepare_generation(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    generation_config: GenerationConfig | None,
    logits_processor: LogitsProcessorList | None,
    stopping_criteria: StoppingCriteriaList | None,
    tokenizer: Any,
    generate_kwargs: dict[str, Any],
) -> PreparedGeneration:
    """Merge configs and build processors/criteria exactly as `generate` would for this call."""
    _check_inputs(model, input_ids, attention_mask)
    has_default_max_length = _is_default(model, generation_config, generate_kwargs, "max_length")
    has_default_min_length = _is_default(model, generation_config, generate_kwargs, "min_length")
    config, model_kwargs = model._prepare_generation_config(generation_config, **generate_kwargs)
    _refuse_unsupported(config, model_kwargs)

    batch_size, prompt_length = input_ids.shape
    model._prepare_special_tokens(config, attention_mask is not None, device=input_ids.device, batch_size=batch_size)
    if attention_mask is None:
        attention_mask = model._prepare_attention_mask_for_generation(input_ids, config, {})
    config = model._prepare_generated_length(
        generation_config=config,
        has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length,
        model_input_name="input_ids",
        input_ids_length=prompt_length,
        inputs_tensor=input_ids,
    )
    model._validate_generated_length(config, prompt_length, has_default_max_length)
    user_processors = logits_processor if logits_processor is not None else LogitsProcessorList()
    processors = _build_processors(model, config, input_ids, attention_mask, user_processors)
    # Some processors hold per-row state (e.g. repetition penalty's prompt_ignore_length = padding
    # lengths), so rows processed alone need their own list, built from their own prompt row.
    row_processors = (
        [processors]
        if batch_size == 1
        else [
            _build_processors(model, config, input_ids[b : b + 1], attention_mask[b : b + 1], user_processors)
            for b in range(batch_size)
        ]
    )
    criteria = model._get_stopping_criteria(
        generation_config=config,
        stopping_criteria=stopping_criteria if stopping_criteria is not None else StoppingCriteriaList(),
        tokenizer=tokenizer,
    )
    pad = config._pad_token_tensor
    return PreparedGeneration(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        generation_config=config,
        logits_processor=processors,
        row_logits_processors=row_processors,
        stopping_criteria=criteria,
        pad_token_id=None if pad is None else int(pad),
        max_length=int(config.max_length),
    )


def _build_processors(model, config, input_ids, attention_mask, user_processors) -> LogitsProcessorList:
    return model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids,
        logits_processor=user_processors,
        device=input_ids.device,
        model_kwargs={"attention_mask": attention_mask},
    )


def _is_default(model: torch.nn.Module, config: GenerationConfig | None, kwargs: dict, name: str) -> bool:
    """Mirror of generate()'s has_default_max_length / has_default_min_length."""
    return (
        kwargs.get(name) is None
        and (config is None or getattr(config, name) is None)
        and getattr(model.generation_config, name) is None
    )


def _check_inputs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("Quasar speculative generation supports decoder-only causal LMs, not encoder-decoder models.")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise TypeError(
            "input_ids must be a LongTensor of shape [batch, prompt_length] (use tokenizer(..., return_tensors='pt'))."
        )
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: speculative generation needs a prompt of at least one token.")
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


def _refuse_unsupported(config: GenerationConfig, model_kwargs: dict) -> None:
    """Clear errors for options the speculative loop does not implement (never a silent fallback)."""
    for name, (neutral, what) in _UNSUPPORTED_OPTIONS.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral:
            raise ValueError(f"quasar speculative generation does not support {what} ({name}={value!r}); remove it.")
    if config.cache_implementation not in _SUPPORTED_CACHES:
        raise ValueError(
            f"quasar speculative generation needs a dynamic KV cache (it crops rejected drafts); "
            f"cache_implementation={config.cache_implementation!r} is not supported."
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
