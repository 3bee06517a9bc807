"""Per-layer W8A8 error report: the error split by hand, the smoothing bookkeeping on tiny models, the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401  (registers quant_method "quasar")
from benchmarks.fidelity.per_layer_report import main as per_layer_main
from quasar_hf import QuasarConfig, W8A8Linear
from quasar_hf.bench.per_layer import evaluate_per_layer, linear_frames
from quasar_hf.hf.fusion import projections_apart
from quasar_hf.ops.reference import w8a8_linear_reference
from quasar_hf.smoothquant.linear_error import add_output_errors, column_row_factors, new_error_sums, summarize
from quasar_hf.smoothquant.mappings import resolve_mappings
from tests.helpers.tiny_models import char_tokenizer, outlier_model, save_outlier, tiny_model

# nearest rounding: the bookkeeping checks below use its half-step bound (GPTQ has its own test)
FAST = dict(num_calibration_samples=4, calibration_seq_len=64, alpha=0.5, weight_rounding="nearest")
TEXTS = ["def add(a, b):\n    return a + b\n" * 4, "The quick brown fox jumps over the lazy dog. " * 4]


def quantize(path, **kwargs):
    config = QuasarConfig(**{**FAST, **kwargs})
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.float32).eval()


# ---------------------------------------------------------------- the split, by hand
def representable(rows: int, cols: int, step: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 q [rows, cols] with |q| max 127 in every row, q * step): exactly representable in int8."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, cols), generator=g)
    q[:, 0] = 127
    return q.to(torch.int8), q.float() * step


def test_split_is_zero_where_values_are_representable():
    w_q, w = representable(6, 16, 2.0**-6, 0)
    scale = torch.full((6,), 2.0**-6)
    _, x_exact = representable(5, 16, 2.0**-3, 1)
    sums = add_output_errors(new_error_sums(), x_exact, w, w_q, scale)
    assert sums["weight"] == sums["act"] == sums["both"] == 0.0 and sums["reference"] > 0

    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    s = summarize(add_output_errors(new_error_sums(), x, w, w_q, scale))
    assert s["weight_rel_mse"] == 0.0 and s["act_rel_mse"] > 0 and s["act_rel_mse"] == s["both_rel_mse"]


def test_both_is_the_reference_w8a8_and_row_scale_moves_to_original_coordinates():
    g = torch.Generator().manual_seed(3)
    x, w, bias = torch.randn(7, 32, generator=g), torch.randn(12, 32, generator=g), torch.randn(12, generator=g)
    from quasar_hf.ops.reference import quantize_weight_per_channel

    w_q, scale = quantize_weight_per_channel(w)
    sums = add_output_errors(new_error_sums(), x, w, w_q, scale, bias, bias)
    exact = x.double() @ w.double().t() + bias.double()
    expected = (w8a8_linear_reference(x, w_q, scale, bias).double() - exact).pow(2).sum()
    assert sums["both"] == pytest.approx(float(expected), rel=1e-4)  # the oracle's epilogue rounds to fp32
    assert sums["reference"] == pytest.approx(float(exact.pow(2).sum()), rel=1e-12)

    r = torch.rand(12, generator=g) * 10 + 0.1  # y = (x @ (w/r).T) * r: same original output
    w_r = w / r[:, None]
    wq_r, scale_r = quantize_weight_per_channel(w_r)
    scaled = add_output_errors(new_error_sums(), x, w_r, wq_r, scale_r, bias / r, bias / r, r)
    for key in ("weight", "act", "both", "reference"):
        assert scaled[key] == pytest.approx(sums[key], rel=1e-4)


def test_column_row_factors_recover_a_smoothing_exactly():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(20, 30, generator=g)
    w[3, 5] = w[0, 0] = 0.0  # zeros carry no ratio
    c, r = torch.rand(30, generator=g) * 50 + 0.02, torch.rand(20, generator=g) * 8 + 0.1
    smoothed = w * c / r[:, None]
    c_hat, r_hat = column_row_factors(w, smoothed)
    torch.testing.assert_close(w * c_hat / r_hat[:, None], smoothed, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c_hat / c, (c_hat / c)[:1].expand(30), rtol=1e-5, atol=0)  # c up to one constant


# ---------------------------------------------------------------- the bookkeeping on tiny models
@pytest.fixture(scope="module", params=["llama", "qwen2"])
def outlier_pair(request, tmp_path_factory):
    arch = request.param
    src = save_outlier(tmp_path_factory.mktemp(arch), arch)
    return arch, quantize(src), outlier_model(arch)


def test_report_lists_every_quantized_linear_with_exact_bookkeeping(outlier_pair):
    arch, quantized, reference = outlier_pair
    result = evaluate_per_layer(quantized, reference, char_tokenizer(), TEXTS, seq_len=48, max_windows=3)
    report = result["report"]
    names = [row["name"] for row in report["rows"]]
    assert sorted(names) == sorted(quantized.config.quantization_config.quantized_modules)
    assert [r["both_rel_mse"] for r in report["rows"]] == sorted((r["both_rel_mse"] for r in report["rows"]), reverse=True)
    for row in report["rows"]:
        # fp32 model: the reconstructed smoothed weight rounds to the int8 weight (half a step, nothing more)
        assert row["step_residual"] <= 0.5 + 1e-3, row
        w, a, both = row["weight_rel_mse"], row["act_rel_mse"], row["both_rel_mse"]
        assert 0 < w and 0 < a and max(w, a) <= 1.05 * both <= 1.05 * 1.5 * (w + a), row
        assert 20 < row["both_sqnr_db"] < 60, row
    totals = report["totals"]
    assert totals["linears"] == len(names) and sum(k["linears"] for k in report["by_kind"].values()) == len(names)
    assert 0.8 < totals["both_rel_mse"] / (totals["weight_rel_mse"] + totals["act_rel_mse"]) < 1.2  # errors add


def test_gptq_models_are_reported_within_their_own_residual_bound(tmp_path):
    from quasar_hf.bench.per_layer import MAX_STEP_RESIDUAL_GPTQ

    src = save_outlier(tmp_path, "llama")
    quantized = quantize(src, weight_rounding="gptq")
    result = evaluate_per_layer(quantized, outlier_model("llama"), char_tokenizer(), TEXTS, seq_len=48, max_windows=3)
    residuals = [row["step_residual"] for row in result["report"]["rows"]]
    assert max(residuals) > 0.5 + 1e-3  # GPTQ moved some weights past nearest rounding, on purpose
    assert max(residuals) <= MAX_STEP_RESIDUAL_GPTQ


def test_unsmoothed_input_is_the_float_models_input(outlier_pair):
    """q_proj's captured input times its column factor is the float input_layernorm applied to the same hidden state."""
    _, quantized, reference = outlier_pair
    arch = resolve_mappings(reference)
    with pytest.raises(ValueError, match="projections_apart"):
        linear_frames(quantized, reference, arch)  # fused projections: refused, naming the way
    with projections_apart(quantized):
        frames = linear_frames(quantized, reference, arch)
        layer = quantized.model.layers[1]
        seen = {}
        hooks = [
            layer.input_layernorm.register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0])),
            layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("x_s", a[0])),
        ]
        with torch.no_grad():
            quantized(torch.tensor([[5, 17, 33, 2, 71, 40, 9, 88]]))
            expected = reference.model.layers[1].input_layernorm(seen["h"])
        for h in hooks:
            h.remove()
    frame = frames["model.layers.1.self_attn.q_proj"]
    assert (frame.column - 1).abs().max() > 1, "outliers must make the factors far from 1"
    torch.testing.assert_close(seen["x_s"] * frame.column, expected, rtol=1e-5, atol=1e-6)


def test_wrong_float_model_is_refused(outlier_pair):
    arch, quantized, _ = outlier_pair
    with pytest.raises(ValueError, match="not this W8A8 model's original"), projections_apart(quantized):
        linear_frames(quantized, outlier_model(arch, seed=1), resolve_mappings(quantized))


def test_weight_only_error_is_zero_for_representable_weights_without_smoothing(tmp_path):
    model = tiny_model("llama")
    with torch.no_grad():
        for i, linear in enumerate(
            m for n, m in model.named_modules() if n.startswith("model.layers.") and isinstance(m, torch.nn.Linear)
        ):
            linear.weight.copy_(representable(*linear.weight.shape, 2.0**-9, i)[1])
    model.save_pretrained(tmp_path / "src")
    char_tokenizer().save_pretrained(tmp_path / "src")
    quantized = quantize(tmp_path / "src", smoothquant_mappings={"layers_path": "model.layers", "mappings": []}, rotate=[])
    report = evaluate_per_layer(quantized, model, char_tokenizer(), TEXTS, seq_len=48, max_windows=2)["report"]
    assert len(report["rows"]) == 14
    for row in report["rows"]:
        assert row["weight_rel_mse"] == 0.0 and row["act_rel_mse"] == row["both_rel_mse"] > 0, row


def test_cli_writes_markdown_and_strict_json(tmp_path, outlier_pair):
    arch, quantized, reference = outlier_pair
    src, saved = tmp_path / "src", tmp_path / "q"
    reference.save_pretrained(src)
    char_tokenizer().save_pretrained(src)
    quantized.save_pretrained(saved)
    argv = ["--model", str(src), "--quantized", str(saved), "--dtype", "float32", "--seq-len", "48", "--max-windows", "2"]
    json_path, md_path = per_layer_main([*argv, "--out", str(tmp_path / "out"), "--name", "tiny"])

    def no_infinity(token):
        raise AssertionError(f"non-standard JSON constant {token}")

    data = json.loads(open(json_path).read(), parse_constant=no_infinity)
    assert data["environment"]["versions"]["torch"] and "load_average" in data["environment"]
    assert data["command"].startswith("python -m benchmarks per-layer --model")
    markdown = open(md_path).read()
    for name in quantized.config.quantization_config.quantized_modules:
        assert f"| {name} |" in markdown
    assert any(isinstance(m, W8A8Linear) for m in quantized.modules())
    preview = data["report"]["keep_float_preview"]
    assert preview["added_bytes"] <= 0.05 * preview["int8_weight_bytes"] and "## keep_float price" in markdown


def test_kept_float_producers_are_unsmoothed_too(tmp_path):
    """With keep_float, a float v_proj/up_proj still scales its output rows: o_proj/down_proj are reconstructed from it."""
    src = save_outlier(tmp_path / "src", "qwen2")
    kept = ["model.layers.0.mlp.up_proj", "model.layers.0.self_attn.v_proj"]
    quantized = quantize(src, keep_float=kept)
    result = evaluate_per_layer(quantized, outlier_model("qwen2"), char_tokenizer(), TEXTS, seq_len=48, max_windows=2)
    rows = {row["name"]: row for row in result["report"]["rows"]}
    assert len(rows) == 12 and not set(kept) & set(rows)
    for consumer in ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj"):
        assert rows[consumer]["step_residual"] <= 0.5 + 1e-3, rows[consumer]


def test_markdown_puts_each_split_under_its_own_header():
    from quasar_hf.bench.per_layer import report_markdown

    errors = {"both": 3e-4, "weight": 1e-4, "act": 2e-4}
    entry = {f"{s}_rel_mse": v for s, v in errors.items()} | {f"{s}_sqnr_db": -10 * math.log10(v) for s, v in errors.items()}
    row = {"name": "model.layers.0.mlp.down_proj", "step_residual": 0.4, **entry}
    report = {"rows": [row], "totals": {"linears": 1, **entry}, "by_kind": {"down_proj": {"linears": 1, **entry}}}
    result = {"model": "m", "command": "c", "heldout": "h", "quantization": "q", "report": report}
    text = report_markdown(result)
    header = next(line for line in text.splitlines() if line.startswith("| # | linear |"))
    line = next(line for line in text.splitlines() if line.startswith("| 1 | model.layers.0.mlp.down_proj |"))
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in line.split("|")]))
    assert cells["rel MSE both"] == "3.00e-04" and cells["rel MSE weight"] == "1.00e-04" and cells["rel MSE act"] == "2.00e-04"
    assert cells["SQNR both (dB)"] == "35.2" and cells["SQNR weight-only (dB)"] == "40.0"
