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
    ceiling = result["gemm_gflops"]
    assert (
        ceiling["bf16"] > 0 and ceiling["fp32"] > 0 and ceiling["kernel_dtype"] == ("bf16" if build == "avx512bf16" else "fp32")
    )
    assert "Ceiling: torch's 1024-square matmul" in open(md_path).read() and "| kernel / matmul rate |" in open(md_path).read()
    assert "prefill-attention" in open(md_path).read()


def test_a_turn_over_cached_keys_counts_its_pairs_and_matches_the_oracle(tmp_path):
    argv = ["--out", str(tmp_path), "--name", "turn", "--shapes", "SmolLM2-135M", "--lengths", "40", "--history", "90"]
    json_path, md_path = prefill_attention.main([*argv, "--samples", "1", "--oracle-max", "200"])
    (row,) = json.loads(open(json_path).read())["kernel"]
    assert row["history"] == 90 and row["flops"] == 4 * 9 * 64 * (40 * 90 + 40 * 41 // 2)  # 9 heads of 64
    assert row["kernel_error"]["max_abs"] < 0.05 and row["sdpa_error"]["max_abs"] < 0.05
    assert "over 90 cached keys" in open(md_path).read()


def test_sdpa_of_a_turn_sees_the_bottom_right_triangle():
    q, k, v = prefill_attention.prompt_inputs(heads=4, kv_heads=2, dim=32, length=5, history=7)
    assert k.shape == (1, 2, 12, 32)
    expected = prefill_attention.attention_reference(q, k, v, None, 32**-0.5)
    assert (prefill_attention._sdpa(q, k, v, 32**-0.5).double() - expected).abs().max() < 0.02


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        prefill_attention.main(["--out", str(tmp_path), "--lengths", "0"])
    with pytest.raises(SystemExit):
        prefill_attention.main(["--out", str(tmp_path), "--shapes", "NoSuchModel"])
    with pytest.raises(SystemExit):
        prefill_attention.main(["--out", str(tmp_path), "--history", "-1"])
