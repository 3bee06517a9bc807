"""Every private Transformers name quasar_hf relies on, in one module.

Transformers' private API (underscore names, internal registries, cache layer classes) moves
between 5.x releases. The rest of the package calls the small functions here instead, so an
upgrade changes this file only; `tests/test_layering.py` fails when another module reaches a
private Transformers name. Supported: Transformers 5.17 - 5.24.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


# ---------------------------------------------------------------- attention implementations
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


# ---------------------------------------------------------------- generation
def pad_token_id(generation_config: Any) -> int | None:
    """The pad token `generate` settled on for this call (pad_token_id, or eos when none was set)."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is None:
        pad = generation_config.pad_token_id
    if isinstance(pad, torch.Tensor):
        pad = pad.reshape(-1)[0]
    return None if pad is None else int(pad)


def cache_argument_name(model: nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` (5.24) or `past_key_values` (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(outputs: Any) -> Any:
    """The KV cache a forward returned (its field is named like the argument)."""
    return outputs["cache"] if "cache" in outputs else outputs["past_key_values"]


def is_full_attention_layer(cache_layer: Any) -> bool:
    """True for a plain full-attention dynamic KV layer (a sliding window counts slots, not tokens)."""
    from transformers.cache_utils import DynamicLayer

    return type(cache_layer) is DynamicLayer


# ---------------------------------------------------------------- configs
def name_or_path(model_or_config: Any) -> str:
    """Where a model was loaded from (Hub id or local folder), "" when unknown."""
    name = getattr(model_or_config, "name_or_path", None)
    if not name:
        config = getattr(model_or_config, "config", model_or_config)
        name = getattr(config, "_name_or_path", None)
    return str(name or "")


# ---------------------------------------------------------------- module surgery
def shallow_module_copy(module: nn.Module, replace: dict[str, nn.Module] | None = None) -> nn.Module:
    """A copy of `module` sharing every parameter and child, with its own child table (`replace` swaps children).

    Attribute changes on the copy (e.g. a decoder layer's attention `layer_idx`) leave the original alone.
    """
    new = copy.copy(module)
    new._modules = dict(module._modules)
    for name, child in (replace or {}).items():
        new._modules[name] = child
    return new


def has_accelerate_hook(module: nn.Module) -> bool:
    """True when accelerate dispatches this module (device_map offload hooks move its weights itself)."""
    return hasattr(module, "_hf_hook")


# ---------------------------------------------------------------- quantizer registry
def allow_loading_attributes(config_class: type) -> bool:
    """Let `from_pretrained(saved_checkpoint, quantization_config=config_class(...))` apply the
    passed config's `get_loading_attributes()` over the saved config, as Transformers does for its
    own configs listed in `quantizers.auto.LOADING_ATTRIBUTES_CONFIG_TYPES` (otherwise it keeps the
    saved config and ignores the passed one). Idempotent; False if this Transformers has no such list.
    """
    from transformers.quantizers import auto

    types = getattr(auto, "LOADING_ATTRIBUTES_CONFIG_TYPES", None)
    if not isinstance(types, tuple):
        return False
    if config_class not in types:
        auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*types, config_class)
    return True
