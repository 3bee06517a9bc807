"""compressed-tensors W8A8 export: read back by the compressed-tensors library and by
Transformers' compressed-tensors support, same dequantized weights, logits close to ours."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from quasar_hf.export.compressed_tensors import export_compressed_tensors, fold_prescale, is_w8a8_module
from quasar_hf.hf.fusion import projections_apart
from quasar_hf.nn import W8A8Linear
from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny

pytest.importorskip("compressed_tensors", reason="the compressed-tensors library is needed to read the export back")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return quantize_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("base")), rotate=[])  # plain W8A8: no transform


def w8a8_modules(model):
    """Each W8A8 projection under its checkpoint name, as a module of its own (fused groups split)."""
    with projections_apart(model):
        return {name: module for name, module in model.named_modules() if is_w8a8_module(module)}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def test_layout_and_config(quantized, tmp_path):
    report = export_compressed_tensors(quantized, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    group = config["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["weights"] == {**group["weights"], "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"] is True
    assert config["ignore"] == ["lm_head"]
    tensors = load_file(tmp_path / "model.safetensors")
    for name, module in w8a8_modules(quantized).items():
        assert tensors[f"{name}.weight"].dtype == torch.int8
        assert tensors[f"{name}.weight_scale"].shape == (module.out_features, 1)
    assert len(report.quantized_modules) == 14 and not report.folded_prescale_modules


def test_compressed_tensors_decompresses_to_our_weights(quantized, tmp_path):
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    export_compressed_tensors(quantized, tmp_path)
    config = QuantizationConfig.model_validate(json.loads((tmp_path / "config.json").read_text())["quantization_config"])
    scheme = config.config_groups["group_0"]
    tensors = load_file(tmp_path / "model.safetensors")
    for name, module in w8a8_modules(quantized).items():
        local = {"weight": tensors[f"{name}.weight"], "weight_scale": tensors[f"{name}.weight_scale"]}
        weight = IntQuantizationCompressor.decompress(local, scheme)["weight"]
        assert torch.equal(weight.float(), module.dequantized_weight(torch.float32)), name


def export_and_reload(model, folder):
    """Export `model`, load the folder with Transformers' compressed-tensors support, and run both on
    the same ids: (loaded model, ids, our logits, its logits)."""
    export_compressed_tensors(model, folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return loaded, ids, model(ids).logits, loaded(ids).logits


def test_transformers_loads_the_export_with_close_logits(quantized, tmp_path):
    loaded, _, ours, theirs = export_and_reload(quantized, tmp_path)
    # Same int8 weights; activations differ only in CT's fake-quant rounding (amax/127.5, half-to-even)
    # against our amax/127 (which is also vLLM's): a fraction of one int8 step per element.
    assert relative_error(theirs, ours) < 0.02
    for name, module in w8a8_modules(quantized).items():
        assert torch.equal(loaded.get_submodule(name).weight.float(), module.dequantized_weight(torch.float32)), name


def test_unfolded_prescale_is_folded_or_refused(quantized, tmp_path):
    name = "model.layers.1.mlp.down_proj"
    original = quantized.get_submodule(name)
    prescale = torch.rand(original.in_features, generator=torch.Generator().manual_seed(0)) + 0.5
    module = W8A8Linear(original.in_features, original.out_features, has_act_prescale=True)
    module.weight.copy_(original.weight), module.weight_scale.copy_(original.weight_scale), module.act_prescale.copy_(prescale)
    quantized.set_submodule(name, module)
    try:
        with pytest.raises(ValueError, match="act_prescale"):
            export_compressed_tensors(quantized, tmp_path / "refused", fold_act_prescale=False)
        report = export_compressed_tensors(quantized, tmp_path / "folded")
        assert report.folded_prescale_modules == [name]
        assert 0 < report.max_fold_rel_error < 0.01  # one requantization: well under one int8 step
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "folded", dtype=torch.float32).eval()
        ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert relative_error(loaded(ids).logits, quantized(ids).logits) < 0.03
    finally:
        quantized.set_submodule(name, original)


def test_fold_prescale_matches_the_product():
    q, scale = W8A8Linear.from_linear(torch.nn.Linear(48, 32)).weight, torch.rand(32) / 100
    prescale = torch.rand(48) + 0.5
    q_new, scale_new, error = fold_prescale(q, scale, prescale)
    target = q.float() * scale[:, None] * prescale[None, :]
    assert q_new.dtype == torch.int8 and scale_new.shape == (32,)
    assert relative_error(q_new.float() * scale_new[:, None], target) == pytest.approx(error, rel=1e-5)
    assert error < 0.01


def test_refuses_non_quasar_models(tmp_path):
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="Quasar"):
        export_compressed_tensors(model, tmp_path / "never-written")


@pytest.fixture(scope="module")
def rotated(tmp_path_factory):
    return quantize_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("rotated_base")), rotate=["down_proj"])


def test_rotated_linears_export_as_one_shared_input_transform(rotated, tmp_path):
    report = export_compressed_tensors(rotated, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    names = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert report.rotated_modules == names
    ((group, scheme),) = config["transform_config"]["config_groups"].items()
    assert scheme["type"] == "random-hadamard" and scheme["head_dim"] is None
    assert scheme["apply"] == [{**scheme["apply"][0], "targets": names, "location": "input", "inverse": False}]
    tensors = load_file(tmp_path / "model.safetensors")
    stored = [key for key in tensors if group in key]
    assert stored == [f"{names[0]}.{group}_input.weight"]  # once per group: loaders share it
    rotation = rotated.get_submodule(names[0]).rotation
    assert torch.equal(tensors[stored[0]].double() / rotation.size**0.5, rotation.matrix())


def test_the_rotated_exports_card_says_how_transformers_reads_it_right(rotated, tmp_path):
    """Transformers' compressed-tensors loader (5.x) leaves transform_config alone and nothing in the
    format makes it refuse: the export's config.json and card say so, and the card's recipe (run here
    as written) makes the loaded model right."""
    import re

    folder = tmp_path / "rotated-ct"
    loaded, ids, ours, unrotated = export_and_reload(rotated, folder)
    assert relative_error(unrotated, ours) > 0.1  # from_pretrained alone: W Q weights on unrotated inputs
    said = json.loads((folder / "config.json").read_text())["quasar_export"]
    assert said["rotated_modules"] == 2 and said["transformers"].startswith("from_pretrained alone gives wrong outputs")
    card = (folder / "README.md").read_text()
    assert "from_pretrained alone gives wrong outputs" in card
    (recipe,) = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    namespace: dict = {}
    exec(recipe.replace('path = "rotated-ct"', f"path = {str(folder)!r}"), namespace)
    with torch.no_grad():
        theirs = namespace["model"](ids).logits
    assert relative_error(theirs, ours) < 0.02  # as the unrotated export: activation rounding only


def test_an_unrotated_export_says_transformers_reads_it(quantized, tmp_path):
    export_compressed_tensors(quantized, tmp_path)
    said = json.loads((tmp_path / "config.json").read_text())["quasar_export"]
    assert said["rotated_modules"] == 0 and said["transformers"].startswith("supported")
    assert "```python" not in (tmp_path / "README.md").read_text()


@pytest.mark.parametrize("size", [96, 1536, 4864, 6])  # Paley 12 x 8, 12 x 128, 76 x 64, 3 blocks of 2
def test_transform_matrix_computes_our_rotation(size):
    from quasar_hf.export.ct_transforms import apply_transform_reference, transform_config_and_tensors
    from quasar_hf.ops.hadamard import HadamardRotation, rotate_rows_float64

    rotation = HadamardRotation.for_size(size)
    config, tensors = transform_config_and_tensors({"m.down_proj": rotation}, torch.bfloat16)
    (scheme,) = config["config_groups"].values()
    (matrix,) = tensors.values()
    assert matrix.dtype == torch.bfloat16 and set(matrix.unique().tolist()) == {-1.0, 1.0}  # exact in any dtype
    assert scheme["head_dim"] == (rotation.block if rotation.blocks > 1 else None)
    x = torch.randn(3, size, generator=torch.Generator().manual_seed(size), dtype=torch.float64)
    expected = rotate_rows_float64(x, rotation)
    assert (apply_transform_reference(x, matrix, scheme["head_dim"]) - expected).abs().max() < 1e-12
