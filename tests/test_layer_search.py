"""alpha search on the decoder layer's output: trials leave the layer untouched, and the error they
predict for the chosen alphas is the error of the layer that quantization then builds."""

from __future__ import annotations

import pytest
import torch

from quasar_hf import QuasarConfig
from quasar_hf.hf.quantize_on_load import find_quantizable_linears
from quasar_hf.hf.sequential import active_mappings, quantize_layers_sequentially, smooth_layer, swap_in_w8a8
from quasar_hf.smoothquant.calibration import CalibrationStats, capture_layer_inputs, recording_linear_inputs, run_layer
from quasar_hf.smoothquant.layer_search import per_token_relative_error, search_alphas_on_layer_output
from quasar_hf.smoothquant.mappings import resolve_mappings
from tests.helpers.tiny_archs import four_layer_gemma3, tiny_phi3, token_blocks
from tests.helpers.tiny_models import tiny_model

CPU = torch.device("cpu")


def test_per_token_relative_error_weights_every_token_alike() -> None:
    ref = torch.tensor([[[1000.0, 0.0], [1.0, 0.0]]])  # a massive token and an ordinary one
    out = ref + torch.tensor([[[10.0, 0.0], [0.01, 0.0]]])  # 1 % relative error on both
    assert per_token_relative_error([out], [ref]) == pytest.approx(1e-4)
    assert per_token_relative_error([ref.clone()], [ref]) == 0.0


def _layer_setup(model: torch.nn.Module, index: int = 1):
    """One decoder layer with its calibration stats, float outputs and a runner over the blocks."""
    arch = resolve_mappings(model)
    names = find_quantizable_linears(model, arch.layers_path, ["lm_head"])
    prefix = f"{arch.layers_path}.{index}."
    local = [n[len(prefix) :] for n in names if n.startswith(prefix)]
    layer = model.model.layers[index]
    captured = capture_layer_inputs(model, model.model.layers, token_blocks(), progress=False)
    hidden = captured.hidden
    with torch.no_grad():
        for i in range(index):  # float inputs of layer `index`
            hidden = [run_layer(model.model.layers[i], h, c[i], CPU) for h, c in zip(hidden, captured.calls)]
    stats = CalibrationStats()
    with torch.no_grad(), recording_linear_inputs(layer, local, stats, 16, torch.Generator().manual_seed(0)):
        references = [run_layer(layer, h, c[index], CPU) for h, c in zip(hidden, captured.calls)]

    def run(module: torch.nn.Module) -> list[torch.Tensor]:
        with torch.no_grad():
            return [run_layer(module, h, c[index], CPU) for h, c in zip(hidden, captured.calls)]

    return arch, layer, local, stats, run, references


@pytest.mark.parametrize("arch_name", ["llama", "qwen2", "gemma3", "phi3"])
def test_search_leaves_the_layer_unchanged_and_predicts_the_built_layer(arch_name: str) -> None:
    builders = {"gemma3": four_layer_gemma3, "phi3": lambda: tiny_phi3(layers=3)}
    model = builders.get(arch_name, lambda: tiny_model(arch_name, layers=3))()
    arch, layer, local, stats, run, references = _layer_setup(model)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    weights = {n: layer.get_submodule(n).weight.detach().float().clone() for n in local}
    frozen = {n: w.clone() for n, w in weights.items()}
    mappings = active_mappings(arch, set(local))

    def stats_for(m):
        first = stats.by_module[m.balance[0]]
        return first.absmax, first.samples

    alphas, errors = search_alphas_on_layer_output(layer, mappings, stats_for, weights, [0.2, 0.5, 0.8], run, references, "torch")
    assert set(alphas) == {m.smooth for m in mappings} and set(alphas.values()) <= {0.2, 0.5, 0.8}
    for key, value in layer.state_dict().items():
        assert torch.equal(value, state[key]), f"{key} changed by the search"
    assert all(torch.equal(weights[n], frozen[n]) for n in local)

    # Build the layer with those alphas: its error is the one the last trial measured.
    config = QuasarConfig(alpha="auto", alpha_search="layer", alpha_grid=[0.2, 0.5, 0.8], backend="torch")
    float_weights, prescales, chosen = smooth_layer(layer, 1, local, stats, arch, config, (run, references))
    assert {k.split(".", 1)[1]: v for k, v in chosen.items()} == alphas
    swap_in_w8a8(layer, float_weights, prescales, "torch")
    built = per_token_relative_error(run(layer), references)
    assert built == pytest.approx(errors[mappings[-1].smooth], rel=1e-5, abs=1e-9)
    assert 0 < built < 0.05


def test_layer_search_quantizes_a_model_end_to_end() -> None:
    config = QuasarConfig(alpha="auto", alpha_search="layer", alpha_search_blocks=2, alpha_grid=[0.3, 0.6], backend="torch")
    model = tiny_model("llama", layers=3)
    arch = resolve_mappings(model)
    names = find_quantizable_linears(model, arch.layers_path, config.modules_to_not_convert)
    result = quantize_layers_sequentially(model, arch, names, token_blocks(), config, progress=False)
    local = {n.split(".", 3)[3] for n in names}
    assert len(result.alphas) == 3 * len(active_mappings(arch, local, {"mlp.down_proj"}))  # down_proj: rotated
    assert all(a in config.alpha_grid for a in result.alphas.values())


def test_alpha_search_is_validated() -> None:
    with pytest.raises(ValueError, match="alpha_search must be one of"):
        QuasarConfig(alpha_search="model")
    with pytest.raises(ValueError, match="alpha_search_blocks must be a positive integer"):
        QuasarConfig(alpha_search_blocks=0)
