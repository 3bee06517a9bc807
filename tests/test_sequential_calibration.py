"""Layer-by-layer calibration: captured layer calls reproduce the model, and quantization matches whole-model calibration."""

from __future__ import annotations

import pytest
import torch

from quasar_hf import QuasarConfig
from quasar_hf.hf.quantize_on_load import find_quantizable_linears, quantize_model
from quasar_hf.hf.sequential import quantize_layers_sequentially, rotated_paths, smooth_layer, swap_in_w8a8
from quasar_hf.nn import W8A8Linear
from quasar_hf.smoothquant.calibration import CalibrationStats, capture_layer_inputs, collect_linear_input_stats, run_layer
from quasar_hf.smoothquant.mappings import resolve_mappings
from tests.helpers.tiny_archs import four_layer_gemma3, token_blocks
from tests.helpers.tiny_models import char_tokenizer, tiny_model

TEXTS = ["def add(a, b):\n    return a + b\n" * 4, "The quick brown fox jumps over the lazy dog. " * 4] * 4


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
def test_captured_layer_calls_reproduce_every_hidden_state(arch: str) -> None:
    model = four_layer_gemma3() if arch == "gemma3" else tiny_model(arch, layers=3)
    blocks = token_blocks()
    layers = model.model.layers
    captured = capture_layer_inputs(model, layers, blocks, progress=False)
    assert all(layer.__dict__.get("forward") is None for layer in layers), "bypass bindings removed"
    for block, hidden, calls in zip(blocks, captured.hidden, captured.calls):
        with torch.no_grad():
            expected = model(input_ids=block[None], output_hidden_states=True).hidden_states
        for index, layer in enumerate(layers):
            torch.testing.assert_close(hidden, expected[index], rtol=0, atol=0)
            hidden = run_layer(layer, hidden, calls[index], torch.device("cpu"))
    if arch == "gemma3":  # sliding and global layers really were called differently
        first, second = captured.calls[0][0].kwargs, captured.calls[0][1].kwargs
        assert first["attention_mask"] is not second["attention_mask"]


def test_bypass_is_removed_when_the_forward_fails() -> None:
    model = tiny_model("llama")
    with pytest.raises(IndexError):
        capture_layer_inputs(model, model.model.layers, torch.full((1, 4), 10_000), progress=False)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def _whole_model_reference(model, config: QuasarConfig, blocks: torch.Tensor) -> None:
    """Calibrate the whole float model with hooks, then smooth and quantize each layer from those stats."""
    arch = resolve_mappings(model)
    names = find_quantizable_linears(model, arch.layers_path, config.modules_to_not_convert)
    stats = collect_linear_input_stats(model, blocks, names, progress=False)
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."
        local = [n[len(prefix) :] for n in names if n.startswith(prefix)]
        layer_stats = CalibrationStats(by_module={n: stats.by_module[prefix + n] for n in local})
        rotated = rotated_paths(local, config.rotate)
        float_weights, prescales, _ = smooth_layer(layer, index, local, layer_stats, arch, config, rotated=rotated)
        swap_in_w8a8(layer, float_weights, prescales, config.backend, rotated=rotated)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float_inputs_match_whole_model_calibration_bit_for_bit(arch: str) -> None:
    config = QuasarConfig(alpha=0.5, backend="reference", weight_rounding="nearest")
    blocks = token_blocks()
    reference, sequential = tiny_model(arch, layers=3), tiny_model(arch, layers=3)
    _whole_model_reference(reference, config, blocks)
    arch_map = resolve_mappings(sequential)
    names = find_quantizable_linears(sequential, arch_map.layers_path, config.modules_to_not_convert)
    quantize_layers_sequentially(sequential, arch_map, names, blocks, config, layer_inputs="float", progress=False)
    ref_state, seq_state = reference.state_dict(), sequential.state_dict()
    assert ref_state.keys() == seq_state.keys()
    for key in ref_state:
        torch.testing.assert_close(seq_state[key], ref_state[key], rtol=0, atol=0, msg=key)


def test_quantized_inputs_calibrate_later_layers_on_quantized_activations() -> None:
    config = QuasarConfig(alpha=0.5, backend="reference", weight_rounding="nearest")
    blocks = token_blocks()
    results = {}
    for mode in ("float", "quantized"):
        model = tiny_model("llama", layers=3)
        arch = resolve_mappings(model)
        names = find_quantizable_linears(model, arch.layers_path, config.modules_to_not_convert)
        quantize_layers_sequentially(model, arch, names, blocks, config, layer_inputs=mode, progress=False)
        results[mode] = model.state_dict()
    layer0 = [k for k in results["float"] if k.startswith("model.layers.0.")]
    later = [k for k in results["float"] if k.startswith("model.layers.2.") and k.endswith("weight_scale")]
    assert all(torch.equal(results["float"][k], results["quantized"][k]) for k in layer0)
    assert any(not torch.equal(results["float"][k], results["quantized"][k]) for k in later)


def test_quantize_model_swaps_every_linear_and_stays_close_to_float() -> None:
    model = tiny_model("llama", layers=3)
    blocks = token_blocks()
    with torch.no_grad():
        reference = model(input_ids=blocks).logits
    config = QuasarConfig(
        alpha="auto", calibration_dataset=TEXTS, tokenizer=char_tokenizer(), num_calibration_samples=4, calibration_seq_len=32
    )
    info = quantize_model(model, config, progress=False)
    assert info["layer_inputs"] == "float"
    assert len(config.searched_alphas) == 3 * 3  # up_proj -> down_proj is not smoothed: down_proj is rotated
    linears = [n for n, m in model.named_modules() if isinstance(m, W8A8Linear)]
    assert linears == config.quantized_modules and len(linears) == 3 * 7
    assert config.rotated_modules == [f"model.layers.{i}.mlp.down_proj" for i in range(3)]
    with torch.no_grad():
        logits = model(input_ids=blocks).logits
    assert ((logits - reference).norm() / reference.norm()).item() < 0.05


def test_offloaded_layer_gives_a_clear_error() -> None:
    model = tiny_model("llama")
    model.model.layers[1].to("meta")
    config = QuasarConfig(
        alpha=0.5, calibration_dataset=TEXTS, tokenizer=char_tokenizer(), num_calibration_samples=2, calibration_seq_len=16
    )
    with pytest.raises(ValueError, match="meta device"):
        quantize_model(model, config, progress=False)


def test_unknown_layer_inputs_is_rejected() -> None:
    model = tiny_model("llama")
    config = QuasarConfig(
        alpha=0.5, calibration_dataset=TEXTS, tokenizer=char_tokenizer(), num_calibration_samples=2, calibration_seq_len=16
    )
    with pytest.raises(ValueError, match="layer_inputs"):
        quantize_model(model, config, progress=False, layer_inputs="fp8")
