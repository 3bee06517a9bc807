"""python -m benchmarks step: the fold toggle, the report and its argument checks (no timing)."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401  (registers quant_method "quasar")
from benchmarks.speed import step as breakdown
from quasar_hf import QuasarConfig
from tests.tiny_models import save_tiny


def row(threads, tokens, step):
    parts = {"w8a8_linears_ms": step / 2, "attention_ms": 1.0, "lm_head_ms": 2.0}
    return {"threads": threads, "tokens": tokens, "step_ms": step, **parts, "rest_ms": step / 2 - 3, "x_floor": step / 8}


def report() -> dict:
    return {
        "command": "python python -m benchmarks step --quantized X",
        "environment": {"cpu": "test cpu", "git_commit": "abc"},
        "load_average_end": [0.1, 0.2, 0.3],
        "cache_tokens": 300,
        "steps": 8,
        "model_name": "Tiny-quasar-w8a8",
        "layers": 2,
        "norm_folds": 4,
        "int8_weight_bytes": 10_000_000,
        "lm_head_bytes": 5_000_000,
        "read_gbps": 20.0,
        "copy_gbps_read_plus_write": 15.0,
        "floor_ms": 0.75,
        "w8a8_module_calls": 14,
        "w8a8_kernel_calls": 8,
        "rows": {"2x1": row(2, 1, 10.0), "2x6": row(2, 6, 14.0)},
        "unfolded_rows": {"2x1": row(2, 1, 11.0), "2x6": row(2, 6, 15.0)},
        "llamacpp": {
            "gguf": "t.gguf",
            "gguf_bytes": 16_000_000,
            "floor_ms": 0.8,
            "version": "0.3",
            "rows": {"2x1": row(2, 1, 5.0)},
        },
    }


def test_report_names_the_model_and_compares_folds_and_llamacpp_side_by_side():
    text = breakdown.to_markdown(report())
    assert text.startswith("# Verify step time vs the bytes it reads (Tiny-quasar-w8a8, this CPU)")
    assert "attention (2 calls)" in text
    assert "| 2 | 6 | 14.0 | 15.0 | 1.0 ms (7 %) |" in text  # folded vs computed norms
    assert "| 2 | 1 | 10.0 | 1.25 | 5.0 | 0.62 | 0.50 |" in text  # llama.cpp at half quasar's step


def test_report_without_optional_parts():
    d = report()
    d.update(unfolded_rows={}, llamacpp=None)
    text = breakdown.to_markdown(d)
    assert "norms folded" not in text and "llama.cpp" not in text


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
