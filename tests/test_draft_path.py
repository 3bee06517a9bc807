"""The dual-precision model's self-draft path: exact draft logits, save/reload, errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig
from quasar_hf.nn import RowStableLinear
from quasar_hf.self_draft.layer_search import expected_acceptance_length
from quasar_hf.self_draft.path import self_draft_model
from tests.helpers.tiny_models import char_tokenizer

IDS = torch.tensor([[5, 17, 33, 2, 71, 40, 9, 88]])
FAST = dict(num_calibration_samples=4, calibration_seq_len=64)


@pytest.fixture()
def four_layer_llama(tmp_path):
    from tests.helpers.tiny_models import tiny_model

    model = tiny_model("llama", layers=4)
    model.save_pretrained(tmp_path / "src")
    char_tokenizer().save_pretrained(tmp_path / "src")
    return tmp_path / "src"


def skipped_layer_reference(path, keep: list[int]):
    """The float model with only `keep` layers, built by hand: the oracle for the draft path."""
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref.model.layers = torch.nn.ModuleList([ref.model.layers[i] for i in keep])
    for slot, layer in enumerate(ref.model.layers):
        layer.self_attn.layer_idx = slot
    ref.config.num_hidden_layers = len(keep)
    ref.lm_head = RowStableLinear.from_linear(ref.lm_head)  # the lm_head every Quasar model computes with
    return ref.eval()


def test_float_draft_equals_skipped_layer_reference_and_reloads(four_layer_llama, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(
        four_layer_llama, quantization_config=QuasarConfig(draft_layers=[0, 2], **FAST), dtype=torch.float32
    )
    info = model.config.quantization_config.draft_info
    assert info["layers"] == [0, 2] and info["dtype"] == "model" and info["extra_bytes"] > 0
    draft = self_draft_model(model)
    with torch.no_grad():
        got = draft(IDS).logits
        want = skipped_layer_reference(four_layer_llama, [0, 2])(IDS).logits
    assert torch.equal(got, want), "float draft path must equal the skipped-layer float model exactly"
    # shared, never duplicated: embeddings, norm and lm_head are the verify model's own objects
    assert draft.model.embed_tokens is model.model.embed_tokens and draft.lm_head is model.lm_head

    model.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(self_draft_model(reloaded)(IDS).logits, got)
        assert torch.equal(reloaded(IDS).logits, model(IDS).logits)


def test_auto_selection_records_choice_and_int8_shares_layers(four_layer_llama):
    model = AutoModelForCausalLM.from_pretrained(
        four_layer_llama,
        quantization_config=QuasarConfig(draft_layers="auto", draft_dtype="int8", draft_budget=0.5, **FAST),
        dtype=torch.float32,
    )
    info = model.config.quantization_config.draft_info
    assert 1 <= len(info["layers"]) <= 2 and info["extra_bytes"] == 0 and 0.0 <= info["top1_agreement"] <= 1.0
    assert "greedy" in info["selection"] and "per byte" in info["selection"]
    assert [c["num_layers"] for c in info["candidates"]] == [2, 1]  # searched past the budget, down to the floor
    best = max(info["candidates"], key=lambda c: c["predicted_speedup"])
    assert best["num_layers"] == len(info["layers"]) and info["predicted_speedup"] == best["predicted_speedup"]
    assert not hasattr(model, "quasar_draft")
    draft = self_draft_model(model)
    verify_q = model.model.layers[info["layers"][0]].self_attn.q_proj
    assert draft.model.layers[0].self_attn.q_proj is verify_q  # int8 draft reuses the W8A8 weights
    assert draft.model.layers[0].self_attn.layer_idx == 0  # but has its own KV-cache slot
    with torch.no_grad():
        assert torch.isfinite(draft(IDS).logits).all()


def test_no_draft_path_is_a_clear_error(four_layer_llama):
    model = AutoModelForCausalLM.from_pretrained(four_layer_llama, quantization_config=QuasarConfig(**FAST), dtype=torch.float32)
    with pytest.raises(ValueError, match="draft_layers"):
        self_draft_model(model)


def test_out_of_range_draft_layers(four_layer_llama):
    with pytest.raises(ValueError, match="out of range"):
        AutoModelForCausalLM.from_pretrained(
            four_layer_llama, quantization_config=QuasarConfig(draft_layers=[1, 9], **FAST), dtype=torch.float32
        )


def test_expected_acceptance_length():
    assert expected_acceptance_length(0.0) == 1.0
    assert expected_acceptance_length(1.0) == 6.0
    assert abs(expected_acceptance_length(0.5, 1) - 1.5) < 1e-12
