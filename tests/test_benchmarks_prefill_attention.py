"""`python -m benchmarks prefill-attention`: the kernel and SDPA timed side by side, errors beside them."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.kernels import prefill_attention
from quasar_hf import QuasarConfig
from quasar_hf.ops import native
from tests.helpers.tiny_models import save_tiny

pytestmark = pytest.mark.kernels("prefill_attention")


def test_report_times_both_and_checks_them_against_the_oracle(tmp_path):
    tiny = save_tiny(tmp_path / "tiny", "qwen3", dtype=torch.bfloat16)  # head size 128
    config = QuasarConfig(alpha=0.5, num_calibration_samples=4, calibration_seq_len=64)
    model = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "quasar")
    argv = ["--out", str(tmp_path), "--name", "pa", "--shapes", "SmolLM2-135M", "--lengths", "70", "130"]
    argv += ["--samples", "1", "--oracle-max", "100", "--checkpoint", str(tmp_path / "quasar"), "--accuracy-prompts", "2"]
    json_path, md_path = prefill_attention.main(argv)
    result = json.loads(open(json_path).read())
    assert [r["length"] for r in result["kernel"]] == [70, 130]
    for r in result["kernel"]:
        assert r["sdpa_ms"] > 0 and r["kernel_ms"] > 0
    assert result["kernel"][0]["kernel_error"]["max_abs"] < 0.05 and "kernel_error" not in result["kernel"][1]
    for r in result["prefill"]:
        assert r["kernel_s"] > 0 and r["kernel_max_logit_diff"] < 1.0 and r["sdpa_max_logit_diff"] < 1.0
        assert 0 <= r["kernel_same_argmax"] <= 2 and r["kernel_mean_logit_diff"] <= r["kernel_max_logit_diff"]
    build = native.kernel_builds()["prefill_attention"][0]  # which build ran, in words
    assert result["build"] == build and f"({build} build)" in open(md_path).read()
    assert "prefill-attention" in open(md_path).read()


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        prefill_attention.main(["--out", str(tmp_path), "--lengths", "0"])
    with pytest.raises(SystemExit):
        prefill_attention.main(["--out", str(tmp_path), "--shapes", "NoSuchModel"])
