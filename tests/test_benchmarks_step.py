"""python -m benchmarks step on a tiny checkpoint: what it times, the fold toggle, its argument checks."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import quasar_hf  # noqa: F401  (registers quant_method "quasar")
from benchmarks.speed import step as breakdown
from quasar_hf import QuasarConfig, compat
from quasar_hf.nn import NormFoldedW8A8Linear, W8A8Linear
from tests.helpers.tiny_models import save_tiny


@pytest.fixture(scope="module")
def tiny_quantized(tmp_path_factory) -> str:
    """A saved 2-layer BF16 Quasar checkpoint."""
    folder = tmp_path_factory.mktemp("step")
    src = save_tiny(folder / "src", "llama", dtype=torch.bfloat16)
    config = QuasarConfig(num_calibration_samples=2, calibration_seq_len=32, weight_rounding="nearest")
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=torch.bfloat16)
    model.save_pretrained(folder / "quantized")
    return str(folder / "quantized")


def test_a_run_times_the_attention_linears_and_lm_head_the_model_calls(tiny_quantized, tmp_path):
    out = tmp_path / "step.json"
    args = ["--quantized", tiny_quantized, "--steps", "4", "--cache-tokens", "40", "--bandwidth-mib", "8", "--out", str(out)]
    breakdown.main(args)
    result = json.loads(out.read_text())
    threads = sorted({torch.get_num_threads(), 1}, reverse=True)
    assert list(result["rows"]) == [f"{t}x{n}" for t in threads for n in (1, 6)]
    assert result["attention_calls"] == result["layers"] == 2  # every layer's attention, through the registry
    for row in result["rows"].values():
        assert row["attention_calls"] == 2 and row["lm_head_calls"] == 1
        assert row["w8a8_linears_calls"] == result["w8a8_kernel_calls"] > 0
        assert min(row["attention_ms"], row["w8a8_linears_ms"], row["lm_head_ms"]) > 0
        parts = row["w8a8_linears_ms"] + row["attention_ms"] + row["lm_head_ms"] + row["rest_ms"]
        assert parts == pytest.approx(row["step_ms"])
        assert row["x_floor"] == pytest.approx(row["step_ms"] / result["floor_ms"])
    if result["norm_folds"]:  # unfolded, each norm's projections are their own W8A8 calls again
        assert list(result["unfolded_rows"]) == list(result["rows"])
        for key, row in result["unfolded_rows"].items():
            assert row["w8a8_linears_calls"] > result["rows"][key]["w8a8_linears_calls"]
    text = (tmp_path / "step.md").read_text()
    assert text.startswith("# Verify step time vs the bytes it reads (quantized, this CPU)")
    assert "attention (2 calls)" in text and "40-token cache" in text


def test_the_instrumentation_is_removed_after_the_run(tiny_quantized):
    model = breakdown.load_model(tiny_quantized)
    name = compat.attn_implementation(model)
    before = (ALL_ATTENTION_FUNCTIONS[name], W8A8Linear.forward, NormFoldedW8A8Linear.forward)
    with breakdown.instrumented(model) as timers:
        with torch.no_grad():
            model(torch.tensor([[3, 14, 15]]))
        assert timers["attention"].calls == 2 and timers["lm_head"].calls == 1
    assert (ALL_ATTENTION_FUNCTIONS[name], W8A8Linear.forward, NormFoldedW8A8Linear.forward) == before
    assert "forward" not in model.lm_head.__dict__


def test_missing_gguf_is_refused_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", ["verify_step_breakdown.py", "--gguf", str(tmp_path / "none.gguf")])
    with pytest.raises(SystemExit, match="no such file"):
        breakdown.main()


@pytest.mark.kernels("w8a8")  # the norm fold needs the fused CPU kernel
def test_set_folded_toggles_every_fold(tmp_path):
    src = save_tiny(tmp_path / "src", "llama")
    config = QuasarConfig(num_calibration_samples=4, calibration_seq_len=64, weight_rounding="nearest")
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.no_grad():
        folded = model(ids).logits
        assert breakdown.set_folded(model, False) == 0
        assert not any(type(m).__name__ == "NormFoldedW8A8Linear" for m in model.modules())
        assert breakdown.set_folded(model, True) == 4
        assert torch.equal(model(ids).logits, folded)
