"""Smoothing alone leaves an fp32 model's function unchanged, for every mapping kind and architecture.

Each test makes a few channels of the smoothed activation large (so the SmoothQuant factors are
far from 1), collects real calibration statistics on random tokens, smooths one mapping of every
decoder layer, writes the smoothed fp32 weights back and compares the logits with the original.
"""

from __future__ import annotations

import copy

import pytest
import torch

from quasar_hf.smoothquant.calibration import collect_linear_input_stats
from quasar_hf.smoothquant.mappings import SmoothMapping, resolve_mappings
from quasar_hf.smoothquant.smoothing import smooth_mapping
from tests.helpers.tiny_models import tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
MAPPINGS = {
    "norm->qkv": SmoothMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    "v->o (GQA)": SmoothMapping("self_attn.v_proj", ("self_attn.o_proj",), kind="grouped_linear"),
    "norm->gate/up": SmoothMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    "up->down": SmoothMapping("mlp.up_proj", ("mlp.down_proj",), kind="linear"),
}
OUTLIER_CHANNELS = [3, 17, 29]
GRID = [0.0, 0.5, 0.8, 1.0]


def _with_outliers(model: torch.nn.Module, mapping: SmoothMapping) -> None:
    """Scale a few output channels of each layer's smooth module so its activations have outliers."""
    for layer in model.model.layers:
        smooth = layer.get_submodule(mapping.smooth)
        with torch.no_grad():
            if mapping.kind == "norm":
                smooth.weight[OUTLIER_CHANNELS] *= 40.0
            else:
                smooth.weight[OUTLIER_CHANNELS, :] *= 40.0
                if smooth.bias is not None:
                    smooth.bias[OUTLIER_CHANNELS] *= 40.0


def _smooth_only(model: torch.nn.Module, mapping: SmoothMapping, alpha) -> list[float]:
    """Smooth `mapping` in every decoder layer (no quantization); returns the chosen alphas."""
    names = [f"model.layers.{i}.{mapping.balance[0]}" for i in range(len(model.model.layers))]
    blocks = torch.randint(0, 96, (4, 48), generator=torch.Generator().manual_seed(1))
    stats = collect_linear_input_stats(model, blocks, names, max_sample_rows=128, progress=False)
    alphas = []
    for index, layer in enumerate(model.model.layers):
        paths = (*mapping.balance, mapping.smooth) if mapping.kind != "norm" else mapping.balance
        float_weights = {p: layer.get_submodule(p).weight.detach().clone() for p in paths}
        entry = stats.by_module[names[index]]
        result = smooth_mapping(layer, mapping, entry.absmax, entry.samples, alpha, GRID, float_weights)
        assert result.prescale == {}, "every built-in mapping kind folds its factors into weights"
        with torch.no_grad():
            for path, weight in float_weights.items():
                layer.get_submodule(path).weight.copy_(weight)
        alphas.append(result.alpha)
    return alphas


def _max_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", list(MAPPINGS))
@pytest.mark.parametrize("alpha", [0.8, "auto"])
def test_smoothing_leaves_fp32_outputs_unchanged(arch: str, kind: str, alpha) -> None:
    mapping = MAPPINGS[kind]
    model = tiny_model(arch, seed=3)
    assert mapping in resolve_mappings(model).mappings
    _with_outliers(model, mapping)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    before = copy.deepcopy(model.model.layers[0].get_submodule(mapping.balance[0]).weight)

    _smooth_only(model, mapping, alpha)

    after = model.model.layers[0].get_submodule(mapping.balance[0]).weight
    factors = (after / before)[0]  # column factors s_j of the first balance linear, row 0
    assert factors.max() / factors.min() > 5.0, "factors must be far from 1 for the test to mean anything"
    with torch.no_grad():
        smoothed = model(input_ids=ids).logits
    assert _max_relative_error(smoothed, reference) < 2e-5


def test_grouped_factors_are_shared_by_the_query_heads_of_one_kv_head() -> None:
    """v -> o under GQA: o_proj columns that read the same KV channel get the same factor."""
    model = tiny_model("llama", seed=3)
    mapping = MAPPINGS["v->o (GQA)"]
    _with_outliers(model, mapping)
    before = model.model.layers[0].self_attn.o_proj.weight.detach().clone()
    _smooth_only(model, mapping, 0.8)
    factors = (model.model.layers[0].self_attn.o_proj.weight / before)[0]  # [num_heads * head_dim]
    heads, kv, head_dim = 4, 2, 16
    per_head = factors.view(kv, heads // kv, head_dim)
    torch.testing.assert_close(per_head[:, 0], per_head[:, 1], rtol=1e-6, atol=0)


def test_in_place_fake_quantization_is_the_reference_dequantized_weight_bit_for_bit() -> None:
    """The alpha search's fake quantization (fp32 operations in place) equals the int8 weight and scale
    `quantize_weight_per_channel` returns, dequantized: the same operations, so exact on every CPU."""
    from quasar_hf.ops.reference import fake_quantize_weight_per_channel_, quantize_weight_per_channel

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(37, 129, generator=gen) * torch.logspace(-3, 2, 129)  # columns of very different size
    w[5] = 0.0  # an all-zero row: scale 0
    w[7, 11] = 0.5 * w[7].abs().max() / 127  # about half its row's step: a rounding tie, up to fp32
    q, scale = quantize_weight_per_channel(w)
    assert torch.equal(fake_quantize_weight_per_channel_(w.clone()), q.float() * scale[:, None])
    with pytest.raises(ValueError, match="2-D float32"):
        fake_quantize_weight_per_channel_(w.double())


def test_alpha_search_error_is_the_same_in_weight_chunks(monkeypatch) -> None:
    """The fake-quantized error summed chunk by chunk (ragged last chunk) is the one-pass error up to
    the order of the float sums, and the search picks the grid point with the least error."""
    from quasar_hf.smoothquant import smoothing

    generator = torch.Generator().manual_seed(5)
    x = torch.randn(64, 48, generator=generator) * torch.linspace(0.1, 8.0, 48)
    weights = [torch.randn(30, 48, generator=generator), torch.randn(17, 48, generator=generator)]
    refs = [x @ w.t() for w in weights]
    act = x.abs().amax(dim=0)
    w_absmax = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0)
    grid = [0.0, 0.25, 0.5, 0.75, 1.0]

    def errors() -> list[float]:
        return [smoothing._fake_quant_error(x, weights, smoothing.smoothing_factors(act, w_absmax, a), refs) for a in grid]

    whole = errors()
    monkeypatch.setattr(smoothing, "SEARCH_CHUNK_ELEMENTS", 7 * 48)  # 7 rows per chunk
    chunked = errors()
    torch.testing.assert_close(torch.tensor(chunked), torch.tensor(whole), rtol=1e-5, atol=0)
    assert len(set(whole)) == len(grid), "the grid points are distinguishable"
    assert smoothing.search_alpha(x, act, weights, grid) == grid[min(range(len(grid)), key=chunked.__getitem__)]
