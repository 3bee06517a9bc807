"""Transformers' generation internals quasar_hf reads: the attention implementation a model runs and
the registries that take new ones, the pad token `generate` settled on, the generation config a call
decodes with, the name of the forward's KV cache argument (and output field), a GenerationConfig field
its save keeps, where a model was loaded from.

Each name moved or changed between 5.x releases (`_attn_implementation`, `_pad_token_tensor`,
`_prepare_generation_config`, `cache` vs `past_key_values`, `_from_model_config`, `_name_or_path`);
callers use these functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def attn_implementation(model_or_config: Any) -> str | None:
    """The attention implementation a model (or its config) runs: "sdpa", "eager", a registered name."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "_attn_implementation", None)


def register_attention_function(name: str, function: Callable, mask_function: Callable | None = None) -> None:
    """Register an attention function (and the mask builder it reads) under `name`, once per process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, function)
    if name not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(name, mask_function or sdpa_mask)


def pad_token_id(generation_config: Any) -> int | None:
    """The pad token `generate` settled on for this call (pad_token_id, or eos when none was set)."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is None:
        pad = generation_config.pad_token_id
    if isinstance(pad, torch.Tensor):
        pad = pad.reshape(-1)[0]
    return None if pad is None else int(pad)


def merged_generation_config(model: nn.Module, generation_config: Any, kwargs: dict) -> tuple[Any, dict]:
    """The GenerationConfig a `generate(generation_config=..., **kwargs)` call decodes with, and the keyword
    arguments it does not absorb (model inputs), merged as generate merges them: the passed config (else a
    default one), the model's generation config under it, the keyword arguments over both. Raises what generate
    raises for them (a model config that sets generation options)."""
    return model._prepare_generation_config(generation_config, **kwargs)


def cache_argument_name(model: nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` (5.24) or `past_key_values` (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(outputs: Any) -> Any:
    """The KV cache a forward returned (its field is named like the argument)."""
    return outputs["cache"] if "cache" in outputs else outputs["past_key_values"]


def set_generation_field(config: Any, name: str, value: Any) -> None:
    """Set a field of a GenerationConfig that its save keeps: a config derived from the model config
    (`_from_model_config`) drops fields Transformers does not know when it is read back, so it is
    marked as a generation config of its own."""
    setattr(config, name, value)
    config._from_model_config = False


def name_or_path(model_or_config: Any) -> str:
    """Where a model was loaded from (Hub id or local folder), "" when unknown."""
    name = getattr(model_or_config, "name_or_path", None)
    if not name:
        config = getattr(model_or_config, "config", model_or_config)
        name = getattr(config, "_name_or_path", None)
    return str(name or "")
