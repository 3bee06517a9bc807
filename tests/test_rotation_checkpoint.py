"""The rotate option: validated config, rotated linears recorded in the checkpoint, reload checks."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig
from quasar_hf.hf.fusion import checkpoint_linears
from quasar_hf.nn import RotatedW8A8Linear, W8A8Linear
from tests.helpers.tiny_models import save_tiny

FAST = dict(num_calibration_samples=4, calibration_seq_len=64)


def test_rotate_option_is_validated_and_old_checkpoints_read_as_unrotated():
    assert QuasarConfig().rotate == ["down_proj"]
    assert QuasarConfig(rotate=["o_proj", "down_proj", "o_proj"]).rotate == ["down_proj", "o_proj"]
    with pytest.raises(ValueError, match="only the inputs of"):
        QuasarConfig(rotate=["q_proj"])
    with pytest.raises(ValueError, match="rotate must be a list"):
        QuasarConfig(rotate="down_proj")
    old = QuasarConfig.from_dict({"quant_method": "quasar", "quantized_modules": ["model.layers.0.mlp.down_proj"]})
    assert old.rotate == []


@pytest.fixture(scope="module")
def rotated_save(tmp_path_factory):
    root = tmp_path_factory.mktemp("rot")
    model = AutoModelForCausalLM.from_pretrained(
        save_tiny(root / "src"), quantization_config=QuasarConfig(**FAST, rotate=["down_proj", "o_proj"]), dtype=torch.float32
    )
    model.save_pretrained(root / "out")
    return model, root / "out"


def test_rotated_linears_are_recorded_and_reload_bit_identical(rotated_save):
    model, out = rotated_save
    config = model.config.quantization_config
    rotated = [n for n, m in model.named_modules() if isinstance(m, RotatedW8A8Linear)]
    assert sorted(rotated) == config.rotated_modules and len(rotated) == 4  # 2 layers x (down_proj, o_proj)
    assert not set(rotated) & set(config.prescaled_modules or [])
    assert config.rotation_info["sizes"] == {"64": [1, 1, 64], "128": [1, 1, 128]}
    linears = checkpoint_linears(model)  # q_proj and gate_proj: in their fused groups, never rotated
    assert all(type(m) is W8A8Linear for n, m in linears.items() if n.endswith(("q_proj", "gate_proj")))
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 17, 33, 2, 71, 40, 9, 88]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
    assert isinstance(reloaded.model.layers[1].mlp.down_proj, RotatedW8A8Linear)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda q: q["rotation_info"].update(construction="another"), "different rotation"),
        (lambda q: q["rotation_info"]["sizes"].update({"128": [2, 1, 64]}), "different rotation"),
        (lambda q: q["rotated_modules"].append("model.layers.0.mlp.up_proj.missing"), "rotated_modules lists"),
    ],
)
def test_a_checkpoint_whose_rotation_this_code_would_not_rebuild_is_refused(rotated_save, tmp_path, edit, message):
    import shutil

    _, out = rotated_save
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    config = json.loads((copy / "config.json").read_text())
    edit(config["quantization_config"])
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(copy)


def test_a_paley_width_reloads(tmp_path):
    """intermediate 152 = 8 x 19: down_proj's rotation is H_76 (Paley II) x H_2, rebuilt at reload under Transformers' meta init."""
    from transformers import LlamaConfig

    from tests.helpers.tiny_models import char_tokenizer

    config = LlamaConfig(
        hidden_size=64, intermediate_size=152, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=128
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    char_tokenizer().save_pretrained(tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src", quantization_config=QuasarConfig(**FAST), dtype=torch.float32)
    assert model.config.quantization_config.rotation_info["sizes"] == {"152": [1, 76, 2]}
    model.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.tensor([[5, 17, 33, 2, 71, 40]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
