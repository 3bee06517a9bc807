"""The one architecture spec (quasar_hf/architectures.py): every path it names exists in a tiny model
of its class, its norm class is the class the model uses, the tables derived from it agree, and an
unknown architecture fails naming what is missing."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from quasar_hf.architectures import (
    ARCHITECTURES,
    ArchitectureSpec,
    RMSNormFormula,
    SmoothMapping,
    UnknownArchitectureError,
    spec_for,
)
from quasar_hf.hf.config import ROTATABLE, QuasarConfig
from quasar_hf.nn.rowstable_norm import rms_norm_formula
from quasar_hf.smoothquant.mappings import SMOOTHQUANT_MAPPINGS, resolve_mappings

MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
}
SIZES = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def tiny(class_name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(MODEL_TYPES[class_name], **SIZES))


def test_every_spec_has_a_tiny_model():
    assert set(ARCHITECTURES) == set(MODEL_TYPES)


@pytest.mark.parametrize("class_name", sorted(MODEL_TYPES))
def test_spec_matches_the_model(class_name):
    model = tiny(class_name)
    assert type(model).__name__ == class_name
    spec = spec_for(model)
    layer = model.get_submodule(spec.layers_path)[0]
    for mapping in spec.mappings:
        for path in (mapping.smooth, *mapping.balance):
            layer.get_submodule(path)  # raises when the spec names a module the model lacks
    for group in spec.fold_groups:
        norm = layer.get_submodule(group.norm)
        assert type(norm).__name__ == spec.norm.class_name
        eps, offset, scale_in_float = rms_norm_formula(norm)
        assert eps == getattr(norm, spec.norm.eps_attribute) and offset == spec.norm.offset
        assert all(isinstance(layer.get_submodule(p), torch.nn.Linear) for p in group.projections)
    folded = {(m.smooth, m.balance) for m in spec.mappings if m.kind == "norm"}
    assert {(g.norm, g.projections) for g in spec.fold_groups} == folded  # each group is smoothed as one
    for path in spec.rotatable:
        assert isinstance(layer.get_submodule(path), torch.nn.Linear)
        assert path.rsplit(".", 1)[-1] in ROTATABLE
    assert resolve_mappings(model).mappings == spec.mappings == SMOOTHQUANT_MAPPINGS[class_name].mappings


def test_unknown_architecture_names_itself_and_the_supported_ones():
    with pytest.raises(UnknownArchitectureError, match=r"'GPT2LMHeadModel'.*Supported: LlamaForCausalLM"):
        spec_for("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="no architecture spec for 'Linear'.*smoothquant_mappings"):
        resolve_mappings(torch.nn.Linear(2, 2))


def test_a_fold_group_offset_must_be_its_norms():
    with pytest.raises(ValueError, match="norm_offset 0.0, its norm 1.0"):
        ArchitectureSpec("model.layers", RMSNormFormula("X", offset=1.0), (SmoothMapping("norm", ("a",)),), ())


def test_rotate_is_checked_against_the_specs():
    assert ROTATABLE == ("down_proj", "o_proj")
    with pytest.raises(ValueError, match="only the inputs of"):
        QuasarConfig(rotate=["q_proj"])


def test_decoder_layers_are_found_where_the_spec_or_the_custom_mappings_say():
    """The self-draft path and the quantizer find decoder layers through one lookup (no path written
    elsewhere): the architecture spec, or the custom SmoothQuant mappings a model was quantized with."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quasar_hf.architectures import UnknownArchitectureError
    from quasar_hf.smoothquant.mappings import layers_path_of, model_decoder_layers

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=64)
    model = LlamaForCausalLM(config)
    assert layers_path_of(model) == "model.layers" and model_decoder_layers(model) is model.model.layers

    class CustomCausalLM(LlamaForCausalLM):  # a class name the spec does not know
        pass

    custom = CustomCausalLM(config)
    with pytest.raises(UnknownArchitectureError, match="CustomCausalLM"):
        layers_path_of(custom)
    custom.config.quantization_config = {
        "quant_method": "quasar",
        "smoothquant_mappings": {"layers_path": "model.layers", "mappings": []},
    }
    assert model_decoder_layers(custom) is custom.model.layers
