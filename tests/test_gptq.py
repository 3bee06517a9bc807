"""GPTQ rounding: same scales and format as nearest rounding, lower output error on correlated inputs."""

from __future__ import annotations

import pytest
import torch

from quasar_hf import QuasarConfig
from quasar_hf.hf.quantize_on_load import find_quantizable_linears
from quasar_hf.hf.sequential import quantize_layers_sequentially
from quasar_hf.nn import W8A8Linear
from quasar_hf.ops.reference import quantize_weight_per_channel
from quasar_hf.smoothquant.calibration import CalibrationStats, recording_linear_inputs
from quasar_hf.smoothquant.gptq import gptq_round, smoothed_hessian
from quasar_hf.smoothquant.mappings import resolve_mappings
from tests.helpers.tiny_archs import token_blocks
from tests.helpers.tiny_models import tiny_model


def _correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """[rows, K] from one fixed distribution with strongly correlated channels; `seed` picks the rows."""
    mix = torch.randn(k, k, generator=torch.Generator().manual_seed(100)) / k**0.5 + torch.eye(k)
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) @ mix


def _output_error(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> float:
    return float(((x @ w.t() - x @ (q.double() * scale.double()[:, None]).float().t()) ** 2).sum())


def test_gptq_keeps_scales_and_lowers_output_error() -> None:
    x = _correlated_inputs(2048, 96)
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(1))
    nearest_q, nearest_scale = quantize_weight_per_channel(w)
    q, scale = gptq_round(w, x.t() @ x, block=32)
    assert q.dtype == torch.int8 and q.shape == w.shape and int(q.abs().max()) <= 127
    torch.testing.assert_close(scale, nearest_scale, rtol=1e-6, atol=0)
    held_out = _correlated_inputs(1024, 96, seed=2)  # same distribution, other rows
    assert _output_error(held_out, w, q, scale) < 0.8 * _output_error(held_out, w, nearest_q, nearest_scale)
    assert (q.int() - nearest_q.int()).abs().max() <= 3  # a few steps, never a different weight


def test_identity_hessian_is_nearest_rounding() -> None:
    w = torch.randn(16, 40, generator=torch.Generator().manual_seed(3))
    q, _ = gptq_round(w, torch.eye(40) * 5.0, damp=0.0)
    assert torch.equal(q, quantize_weight_per_channel(w)[0])


def test_smoothed_hessian_matches_hessian_of_scaled_inputs() -> None:
    x = _correlated_inputs(64, 12)
    c = torch.rand(12) + 0.5
    torch.testing.assert_close(smoothed_hessian(x.t() @ x, c), (x / c).t() @ (x / c), rtol=1e-4, atol=1e-4)


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="GPTQ needs weight"):
        gptq_round(torch.randn(4, 8), torch.eye(4))


def test_siblings_share_one_hessian_and_it_sums_all_tokens() -> None:
    model = tiny_model("llama", layers=1)
    layer = model.model.layers[0]
    names = ["self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"]
    stats = CalibrationStats()
    seen = []
    handle = layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().reshape(-1, 64)))
    with torch.no_grad(), recording_linear_inputs(layer, names, stats, 4, torch.Generator(), hessians=True):
        for block in token_blocks(2, 16):
            model(input_ids=block[None])
    handle.remove()
    x = torch.cat(seen)
    torch.testing.assert_close(stats.by_module["self_attn.q_proj"].hessian, x.t() @ x, rtol=1e-5, atol=1e-4)
    k, up = stats.by_module["self_attn.k_proj"], stats.by_module["mlp.up_proj"]
    assert k.hessian is None and k.hessian_owner == "self_attn.q_proj", "held once, by the first reader"
    assert up.hessian is None and up.hessian_owner == "mlp.gate_proj"
    assert stats.by_module["mlp.gate_proj"].hessian is not None and stats.by_module["mlp.gate_proj"].hessian_owner is None


def test_siblings_rounded_together_get_what_each_gets_alone() -> None:
    """gptq_round of [W_q; W_k] with their shared H: each row block equals that weight rounded alone
    up to the float sums' order (int8 values at most one step apart, nearly all equal)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=generator) * torch.linspace(0.2, 3.0, 64)
    hessian = x.t() @ x
    wq, wk = torch.randn(64, 64, generator=generator), torch.randn(32, 64, generator=generator)
    together, scales = gptq_round(torch.cat([wq, wk]), hessian)
    for part, weight in ((together[:64], wq), (together[64:], wk)):
        alone, alone_scales = gptq_round(weight, hessian)
        assert (part.int() - alone.int()).abs().max() <= 1 and (part == alone).float().mean() > 0.99
    assert torch.equal(scales[:64], gptq_round(wq, hessian)[1])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gptq_quantizes_a_model_with_the_nearest_scales(arch: str) -> None:
    models = {}
    for rounding in ("nearest", "gptq"):
        config = QuasarConfig(alpha=0.5, weight_rounding=rounding, backend="torch")
        model = tiny_model(arch, layers=2)
        arch_map = resolve_mappings(model)
        names = find_quantizable_linears(model, arch_map.layers_path, config.modules_to_not_convert)
        quantize_layers_sequentially(model, arch_map, names, token_blocks(), config, progress=False)
        models[rounding] = model
    nearest, gptq = (dict(m.named_modules()) for m in (models["nearest"], models["gptq"]))
    linears = [n for n, m in nearest.items() if isinstance(m, W8A8Linear)]
    assert linears and all(isinstance(gptq[n], W8A8Linear) for n in linears)
    for name in linears:
        torch.testing.assert_close(gptq[name].weight_scale, nearest[name].weight_scale, rtol=1e-6, atol=0)
    assert any(not torch.equal(gptq[n].weight, nearest[n].weight) for n in linears)


def test_weight_rounding_is_validated() -> None:
    with pytest.raises(ValueError, match="weight_rounding must be one of"):
        QuasarConfig(weight_rounding="awq")


def test_checkpoints_saved_before_the_field_read_back_as_nearest_rounded() -> None:
    saved = QuasarConfig(weight_rounding="nearest").to_dict()
    saved["quantized_modules"] = ["model.layers.0.mlp.down_proj"]
    del saved["weight_rounding"]
    assert QuasarConfig.from_dict(saved).weight_rounding == "nearest"
    assert QuasarConfig.from_dict({}).weight_rounding == "gptq"  # a new config gets the default


def _textbook_gptq(w: torch.Tensor, hessian: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """GPTQ as the paper states it, in float64: U = chol(H^-1) (upper), then column by column,
    quantize and spread the error (w_j - q_j) / U_jj over the later columns by row j of U."""
    h = hessian.double().clone()
    h.diagonal().masked_fill_(h.diagonal() <= 0, 1.0)
    h.diagonal().add_(damp * float(h.diagonal().mean()))
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    wt = w.double().t().clone()  # [K, N]
    scale = wt.abs().amax(dim=0) / 127
    q = torch.empty_like(wt)
    for j in range(wt.shape[0]):
        q[j] = torch.floor(wt[j] / scale + 0.5).clamp(-127, 127)
        wt[j + 1 :] -= torch.outer(u[j, j + 1 :], (wt[j] - q[j] * scale) / u[j, j])
    return q.t().to(torch.int8)


@pytest.mark.parametrize("k, block", [(96, 32), (96, 128), (130, 48)])
def test_gptq_rounds_as_the_textbook_algorithm(k: int, block: int) -> None:
    """The one-Cholesky form gives the paper's int8 values: equal except where the fp32 and float64
    sums straddle a rounding boundary (then one step apart)."""
    x = _correlated_inputs(4 * k, k)
    x[:, 5] = 0.0  # a channel never seen: H_55 = 0
    w = torch.randn(40, k, generator=torch.Generator().manual_seed(4))
    q, _ = gptq_round(w, x.t() @ x, block=block)
    expected = _textbook_gptq(w, x.t() @ x)
    assert (q.int() - expected.int()).abs().max() <= 1
    assert (q == expected).float().mean() > 0.995
