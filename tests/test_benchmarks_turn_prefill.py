"""`python -m benchmarks turn-prefill`: both variants timed in interleaved rounds, the logits equal, the report written."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.speed import turn_prefill
from quasar_hf import QuasarConfig
from tests.helpers.tiny_models import save_tiny


def test_report_times_both_variants_and_compares_their_logits(tmp_path):
    tiny = save_tiny(tmp_path / "tiny", "qwen3", dtype=torch.bfloat16)
    config = QuasarConfig(alpha=0.5, num_calibration_samples=4, calibration_seq_len=64)
    model = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "quasar")
    argv = ["--checkpoint", str(tmp_path / "quasar"), "--history", "90", "--turn", "70", "--rounds", "3"]
    json_path, md_path = turn_prefill.main([*argv, "--out", str(tmp_path), "--name", "tp"])
    report = json.loads(open(json_path).read())
    (row,) = report["rows"]
    assert row["same_logits"] and row["ratio_median"] > 0
    assert all(len(v) == 3 and min(v) > 0 for v in row["ms_by_round"].values())
    assert "MaskFacts per forward ms" in open(md_path).read() and "environment" in report


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        turn_prefill.main(["--checkpoint", str(tmp_path), "--turn", "0"])
