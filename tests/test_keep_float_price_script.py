"""scripts/keep_float_price.py on tiny checkpoints: the kept bytes are counted and every measurement lands in the report."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import load_script
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401
from quasar_hf import QuasarConfig
from tests.test_per_layer import save_outlier

FAST = dict(num_calibration_samples=4, calibration_seq_len=64, alpha=0.5, weight_rounding="nearest")


def _save(src, out, **kwargs) -> str:
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=QuasarConfig(**FAST, **kwargs), dtype=torch.bfloat16)
    model.save_pretrained(out)
    return str(out)


def test_price_report_counts_kept_bytes_and_times_both(tmp_path) -> None:
    src = save_outlier(tmp_path / "src", "llama")
    plain = _save(src, tmp_path / "plain")
    kept = _save(src, tmp_path / "kept", keep_float="auto", keep_float_budget=0.3)
    script = load_script("keep_float_price")
    argv = [f"default={plain}", f"keepauto={kept}", "--rounds", "1", "--steps", "2", "--prompts", "1", "--tokenizer", src]
    written = script.main([*argv, "--max-new-tokens", "8", "--out", str(tmp_path / "out"), "--name", "price"])
    result = json.loads((tmp_path / "out" / "price.json").read_text())
    first, second = result["rows"]
    assert first["kept_float_bytes"] == 0 and second["kept_float_bytes"] > 0 and second["kept_float_linears"] >= 1
    assert second["int8_bytes"] < first["int8_bytes"]  # a kept linear leaves the int8 set
    for row in (first, second):
        assert row["step_1_ms"] > 0 and row["step_6_ms"] > 0 and row["quasar_tokens_per_s"] > 0
    text = (tmp_path / "out" / "price.md").read_text()
    assert "| keepauto |" in text and "keep_float_price.py" in text and str(tmp_path / "out" / "price.md") in written


def test_bad_checkpoint_arguments_name_the_fix(tmp_path) -> None:
    script = load_script("keep_float_price")
    with pytest.raises(SystemExit, match="write label=DIR"):
        script.main(["no-label-here"])
    with pytest.raises(SystemExit, match="not a saved checkpoint folder"):
        script.main([f"x={tmp_path}"])
