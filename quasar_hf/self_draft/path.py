"""The dual-precision model's self-draft path: a few decoder layers, sharing everything else.

Draft path = shared embeddings -> chosen decoder layers -> shared final norm -> shared lm_head.
With draft_dtype="model" the chosen layers are unquantized copies taken *before* smoothing (in
the model's dtype: BF16 for a BF16 model), registered on the model as
`quasar_draft` so they are saved and reloaded. With "int8" the draft reuses the W8A8 verify
layers themselves: no extra memory.

The draft model is a real instance of the model's own class built on the meta device with
`num_hidden_layers = len(layers)` whose modules are then pointed at the shared ones, so its
forward (masks, rotary embeddings, KV cache) is Transformers' own, and its DynamicCache is
its own.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from quasar_hf import compat
from quasar_hf.smoothquant.mappings import layers_path_of, model_decoder_layers

DRAFT_ATTR = "quasar_draft"


def renumbered(layer: nn.Module, index: int, deep: bool) -> nn.Module:
    """A copy of a decoder layer whose attention uses KV-cache slot `index`.

    deep=True copies weights; deep=False shares every submodule except the attention wrapper.
    """
    if deep:
        new = copy.deepcopy(layer)
    else:
        new = compat.shallow_module_copy(layer, replace={"self_attn": compat.shallow_module_copy(layer.self_attn)})
    new.self_attn.layer_idx = index
    return new


def draft_config(config, layer_indices: list[int]):
    """The model config restricted to the chosen layers, without quantization_config."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = len(layer_indices)
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [config.layer_types[i] for i in layer_indices]
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    return cfg


def build_draft_model(model: nn.Module, layer_indices: list[int], layers: list[nn.Module]) -> nn.Module:
    """A causal LM of the same class running `layers` (in order) between the shared ends of `model`."""
    with torch.device("meta"):
        draft = type(model)(draft_config(model.config, layer_indices))
    parent, _, attr = layers_path_of(model).rpartition(".")  # "model", "layers" for Llama-like models
    base, draft_base = model.get_submodule(parent), draft.get_submodule(parent)
    for name, child in base.named_children():
        if name != attr:
            setattr(draft_base, name, child)  # embed_tokens, norm, rotary_emb: shared, never copied
    setattr(draft_base, attr, nn.ModuleList(layers))
    draft.lm_head = model.lm_head
    draft.eval()
    return draft


def attach_draft_layers(model: nn.Module, layer_indices: list[int]) -> nn.ModuleDict:
    """Register unquantized copies of the chosen decoder layers as `model.quasar_draft` (saved with the model)."""
    source = model_decoder_layers(model)
    bad = [i for i in layer_indices if not 0 <= i < len(source)]
    if bad:
        raise ValueError(
            f"draft_layers {bad} are out of range: this model has {len(source)} decoder layers (0..{len(source) - 1})"
        )
    copies = nn.ModuleDict({str(i): renumbered(source[i], slot, deep=True) for slot, i in enumerate(layer_indices)})
    setattr(model, DRAFT_ATTR, copies)
    return copies


def self_draft_model(model: nn.Module) -> nn.Module:
    """The runnable draft path of a Quasar model quantized with draft_layers, or a clear error."""
    qconfig = getattr(model.config, "quantization_config", None)
    info = getattr(qconfig, "draft_info", None) or {}
    indices = info.get("layers")
    if not indices:
        raise ValueError(
            "drafter='self' needs a model quantized with a draft path: "
            "QuasarConfig(draft_layers=[...] or 'auto'). This model was saved without one; "
            "use drafter='ngram' or drafter='assistant' instead."
        )
    if info.get("dtype") == "int8":
        verify_layers = model_decoder_layers(model)
        layers = [renumbered(verify_layers[i], slot, deep=False) for slot, i in enumerate(indices)]
    else:
        copies = getattr(model, DRAFT_ATTR)
        layers = [copies[str(i)] for i in indices]
    return build_draft_model(model, indices, layers)
