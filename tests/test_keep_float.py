"""keep_float: validation, the budgeted choice, float function preserved, save/reload, greedy quasar=True exact."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401  (registers quant_method "quasar")
from quasar_hf import QuasarConfig, W8A8Linear
from quasar_hf.ops.reference import quantize_per_token, quantize_weight_per_channel
from quasar_hf.smoothquant.keep_float import KeepFloatSelector, choose_keep_float
from quasar_hf.smoothquant.linear_error import calibration_error
from tests.helpers.tiny_models import outlier_model, save_outlier

FAST = dict(num_calibration_samples=4, calibration_seq_len=64, alpha=0.5)
IDS = torch.tensor([[5, 17, 33, 2, 71, 40, 9, 88, 12, 3]])


def quantize(path, dtype=torch.float32, **kwargs):
    config = QuasarConfig(**{**FAST, **kwargs})
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=dtype).eval()


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(keep_float="all"), "None, 'auto' or a list"),
        (dict(keep_float=[]), "non-empty list of full module names"),
        (dict(keep_float=["model.layers.0.mlp.down_proj", 3]), "non-empty list of full module names"),
        (dict(keep_float=7), "None, 'auto' or a list"),
        (dict(keep_float_budget=0.0), "keep_float_budget must be a fraction"),
        (dict(keep_float_budget=1.5), "keep_float_budget must be a fraction"),
        (dict(keep_float_budget=True), "keep_float_budget must be a fraction"),
    ],
)
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        QuasarConfig(**bad)


def test_config_roundtrip():
    config = QuasarConfig(keep_float=["b.x", "a.y", "b.x"], keep_float_budget=0.1)
    assert config.keep_float == ["a.y", "b.x"]
    again = QuasarConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again.keep_float == ["a.y", "b.x"] and again.keep_float_budget == 0.1 and again.keep_float_info is None


def test_choose_is_worst_first_within_budget_and_monotone():
    errors = {"a": 5.0, "b": 9.0, "c": 1.0, "d": 3.0}
    added = {"a": 40, "b": 30, "c": 10, "d": 10}
    assert choose_keep_float(errors, added, 1000, 0.1) == ["b", "a", "d", "c"]  # 90 bytes fit in 100
    assert choose_keep_float(errors, added, 1000, 0.075) == ["b", "a"]  # d would make 80
    assert choose_keep_float(errors, added, 1000, 0.065) == ["b"]  # a does not fit: stop, never skip ahead to d
    assert choose_keep_float(errors, added, 1000, 0.02) == []
    # a candidate rejected among fewer names stays rejected among more (the choice can stream layer by layer)
    sub = {k: errors[k] for k in ("a", "c", "d")}
    for budget in (0.02, 0.05, 0.06, 0.1):
        assert set(choose_keep_float(errors, added, 1000, budget)) - {"b"} <= set(choose_keep_float(sub, added, 1000, budget))


def test_calibration_error_undoes_smoothing():
    """The measured W8A8 error of a smoothed linear equals the directly computed W8A8(x/c, W*c) vs x @ W.T."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 32, generator=g), torch.randn(24, 32, generator=g)
    x[:, 3] *= 40  # an outlier channel
    c, r = torch.rand(32, generator=g) * 4 + 0.25, torch.rand(24, generator=g) * 4 + 0.25
    measured = calibration_error(x, w, w * c / r[:, None])
    xq, xs = quantize_per_token(x / c)
    wq, ws = quantize_weight_per_channel(w * c)
    y = (xq.double() * xs.double()) @ (wq.double() * ws.double()[:, None]).t()
    exact = x.double() @ w.double().t()
    expected = float((y - exact).pow(2).sum() / exact.pow(2).sum())
    assert measured["both_rel_mse"] == pytest.approx(expected, rel=1e-3)
    s = torch.ones(32)
    s[3] = 10.0  # migrate the outlier channel into the weight: the measured error must drop
    assert calibration_error(x, w, w * s)["both_rel_mse"] < 0.5 * calibration_error(x, w, w)["both_rel_mse"]


def test_kept_linear_folds_the_prescale_and_keeps_the_bias():
    model = nn.Sequential(nn.Linear(8, 4))
    g = torch.Generator().manual_seed(1)
    smoothed, bias, prescale = torch.randn(4, 8, generator=g), torch.randn(4, generator=g), torch.rand(8, generator=g) + 0.5
    selector = KeepFloatSelector(["0"], 0.05, model, ["0"])
    selector.offer("0", torch.randn(16, 8, generator=g), model[0].weight.detach(), smoothed, bias, prescale)
    model[0] = W8A8Linear.from_weight(smoothed, bias, prescale)
    assert selector.apply(model) == ["0"] and type(model[0]) is nn.Linear
    x = torch.randn(3, 8, generator=g)
    torch.testing.assert_close(model(x), (x * prescale) @ smoothed.t() + bias)


@pytest.fixture(scope="module")
def outlier_src(tmp_path_factory):
    return save_outlier(tmp_path_factory.mktemp("src"), "qwen2")


def test_keeping_every_linear_float_is_the_float_model(outlier_src):
    """Kept linears hold the smoothed weights: with all of them kept, the float function comes back."""
    probe = quantize(outlier_src)
    names = probe.config.quantization_config.quantized_modules
    model = quantize(outlier_src, keep_float=names)
    assert not any(isinstance(m, W8A8Linear) for m in model.modules())
    assert model.config.quantization_config.quantized_modules == []
    with torch.no_grad():
        ref, got = outlier_model("qwen2")(IDS).logits, model(IDS).logits
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    with pytest.raises(ValueError, match=r"keep_float names \['model.layers.0.mlp.nope'\] are not decoder linears"):
        quantize(outlier_src, keep_float=["model.layers.0.mlp.nope"])


def test_auto_keeps_worst_within_budget_saves_reloads_and_greedy_stays_exact(outlier_src, tmp_path):
    model = quantize(outlier_src, dtype=torch.bfloat16, keep_float="auto", keep_float_budget=0.3)
    config = model.config.quantization_config
    info = config.keep_float_info
    kept = info["modules"]
    assert kept and info["added_bytes"] <= 0.3 * info["int8_weight_bytes"]
    for name in kept:
        assert type(model.get_submodule(name)) is nn.Linear and model.get_submodule(name).weight.dtype == torch.bfloat16
        assert name not in config.quantized_modules and name not in (config.prescaled_modules or [])
    assert len(config.quantized_modules) + len(kept) == 14
    # the kept ones are the worst on calibration rows: every kept error >= every other linear's (measured alike)
    everything = quantize(outlier_src, dtype=torch.bfloat16, keep_float=config.quantized_modules + kept)
    all_errors = everything.config.quantization_config.keep_float_info["calibration_error"]
    worst = sorted(all_errors, key=lambda n: -all_errors[n]["rel_mse"])[: len(kept)]
    assert sorted(worst) == kept

    model.save_pretrained(tmp_path / "q")
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert saved["keep_float"] == "auto" and saved["keep_float_info"]["modules"] == kept
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16).eval()
    assert reloaded.config.quantization_config.keep_float_info == info
    for name in kept:
        assert type(reloaded.get_submodule(name)) is nn.Linear
        assert torch.equal(reloaded.get_submodule(name).weight, model.get_submodule(name).weight)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, model(IDS).logits), "reload must not recalibrate or change anything"

    prompt = torch.cat([IDS, IDS, IDS[:, :5]], dim=1)
    plain = reloaded.generate(prompt, max_new_tokens=24, do_sample=False, quasar=False)
    spec = reloaded.generate(prompt, max_new_tokens=24, do_sample=False, quasar=True)
    assert torch.equal(spec, plain)
