"""Quantize-on-load, save/reload and bad-input errors for the Quasar HfQuantizer (tiny models)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import quasar_hf
from quasar_hf import QuasarConfig, W8A8Linear, is_quasar_model
from quasar_hf.hf.fusion import checkpoint_linears
from tests.helpers.tiny_models import save_tiny, tiny_model

IDS = torch.tensor([[5, 17, 33, 2, 71, 40, 9, 88, 12, 3]])
FAST = dict(num_calibration_samples=4, calibration_seq_len=64)


def quantize(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=QuasarConfig(**{**FAST, **kwargs}), dtype=torch.float32)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_quantize_save_reload_bit_identical(tmp_path, arch):
    src = save_tiny(tmp_path / "src", arch)
    model = quantize(src)
    assert is_quasar_model(model)
    linears = [m for n, m in model.named_modules() if n.startswith("model.layers.") and isinstance(m, torch.nn.Linear)]
    assert linears == [], "every decoder linear must be W8A8"
    w8 = checkpoint_linears(model)  # each projection under its own name (q/k/v and gate/up fused)
    assert len(w8) == 2 * 7 and all(m.weight.dtype == torch.int8 for m in w8.values())
    assert len({id(m) for m in w8.values()}) == 2 * 4 and all(isinstance(m, W8A8Linear) for m in w8.values())
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.float32
    if arch == "qwen2":
        assert model.state_dict()["model.layers.0.self_attn.v_proj.bias"] is not None

    with torch.no_grad():
        ref = tiny_model(arch)(IDS).logits
        got = model(IDS).logits
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 0.05, f"W8A8 logits too far from float: relative error {rel:.4f}"

    out = tmp_path / "out"
    model.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    assert saved["quantization_config"]["quant_method"] == "quasar"
    assert saved["architectures"] == [type(model).__name__]
    tensors = load_file(out / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.int8
    assert tensors["model.layers.0.mlp.down_proj.weight_scale"].dtype == torch.float32

    reloaded = AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.config.quantization_config.calibration_info == model.config.quantization_config.calibration_info
    with torch.no_grad():
        again = reloaded(IDS).logits
    assert torch.equal(got, again), "reload must give bit-identical logits"


def test_whole_model_pickles_and_copies_with_its_quasar_methods(tmp_path):
    """pickle and deepcopy of a Quasar model keep generate(quasar=...) bound to the copy itself."""
    import copy
    import pickle

    model = quantize(save_tiny(tmp_path / "src", "llama"))
    prompt = torch.cat([IDS, IDS], dim=1)
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False, quasar=True)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert clone.generate.__self__ is clone and clone.save_pretrained.__self__ is clone
        assert torch.equal(clone.generate(prompt, max_new_tokens=6, do_sample=False, quasar=True), expected)
        with torch.no_grad():
            assert torch.equal(clone(IDS).logits, model(IDS).logits)


def test_bfloat16_reload_keeps_fp32_scales(tmp_path):
    src = save_tiny(tmp_path / "src", "llama", dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=QuasarConfig(**FAST), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    layer = reloaded.model.layers[0].mlp.down_proj
    assert layer.weight_scale.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reloaded(IDS).logits)


def test_config_roundtrip_and_validation():
    config = QuasarConfig(alpha=0.6, draft_layers=[3, 1, 1])
    assert config.draft_layers == [1, 3]
    again = QuasarConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()
    for bad, match in [
        (dict(bits=4), "bits=8"),
        (dict(alpha=1.5), "alpha"),
        (dict(alpha="max"), "alpha"),
        (dict(backend="cuda"), "backend"),
        (dict(num_calibration_samples=0), "num_calibration_samples"),
        (dict(draft_dtype="fp8"), "draft_dtype"),
        (dict(draft_layers="some"), "draft_layers"),
    ]:
        with pytest.raises(ValueError, match=match):
            QuasarConfig(**bad)
    with pytest.raises(ValueError, match="newer quasar_hf"):
        QuasarConfig.from_dict({"quant_method": "quasar", "from_the_future": 1})


def test_register_twice_is_harmless():
    quasar_hf.register_with_transformers()
    quasar_hf.register_with_transformers()


def test_unknown_architecture_fails_loudly():
    from quasar_hf.smoothquant.mappings import resolve_mappings

    class GPTLike(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="Supported: LlamaForCausalLM.*smoothquant_mappings"):
        resolve_mappings(GPTLike())


def test_custom_mappings(tmp_path):
    src = save_tiny(tmp_path / "src", "llama")
    custom = {
        "layers_path": "model.layers",
        "mappings": [{"smooth": "input_layernorm", "balance": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]}],
    }
    model = quantize(src, smoothquant_mappings=custom, alpha=0.5)
    assert set(model.config.quantization_config.to_dict()["smoothquant_mappings"]["mappings"][0]) >= {"smooth", "balance"}
    with pytest.raises(ValueError, match="does not have"):
        quantize(src, smoothquant_mappings={"mappings": [{"smooth": "nope", "balance": ["self_attn.q_proj"]}]})


def _corrupt(tmp_path, edit):
    src = save_tiny(tmp_path / "src", "llama")
    quantize(src).save_pretrained(tmp_path / "out")
    path = tmp_path / "out" / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return tmp_path / "out"


def test_missing_scale_tensor_is_named(tmp_path):
    out = _corrupt(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight_scale"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight_scale"):
        AutoModelForCausalLM.from_pretrained(out)


def test_wrong_dtype_is_named(tmp_path):
    def to_float(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].float()

    out = _corrupt(tmp_path, to_float)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*expected I8"):
        AutoModelForCausalLM.from_pretrained(out)


def test_calibration_data_errors(tmp_path):
    src = save_tiny(tmp_path / "src", "llama")
    with pytest.raises(ValueError, match="empty"):
        quantize(src, calibration_dataset=["", "   "])
    with pytest.raises(ValueError, match="too short"):
        quantize(src, calibration_dataset=["hi"])
    with pytest.warns(UserWarning, match="only"):
        model = quantize(src, calibration_dataset=["some calibration text " * 20], num_calibration_samples=50)
    assert model.config.quantization_config.calibration_info["num_samples"] >= 1


def test_calibration_sources(tmp_path):
    from quasar_hf.smoothquant.data import load_calibration_texts

    (tmp_path / "c.jsonl").write_text('{"text": "alpha beta"}\n{"text": "gamma"}\n')
    (tmp_path / "c.txt").write_text("first paragraph\n\nsecond paragraph\n")
    assert load_calibration_texts(str(tmp_path / "c.jsonl"))[0] == ["alpha beta", "gamma"]
    assert load_calibration_texts(str(tmp_path / "c.txt"))[0] == ["first paragraph", "second paragraph\n"]
    import datasets

    ds = datasets.Dataset.from_dict({"content": ["x y z"]})
    assert load_calibration_texts(ds)[0] == ["x y z"]
    with pytest.raises(ValueError, match="no text column"):
        load_calibration_texts(datasets.Dataset.from_dict({"n": [1]}))
    with pytest.raises(ValueError, match="could not load calibration dataset"):
        load_calibration_texts("surely/not-a-local-or-cached-dataset-name")
    with pytest.raises(ValueError, match="unsupported calibration file"):
        (tmp_path / "c.xml").write_text("<x/>")
        load_calibration_texts(str(tmp_path / "c.xml"))
