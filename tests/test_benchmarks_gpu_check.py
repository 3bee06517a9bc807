"""The GPU check script, exercised on CPU with --tiny (same code paths, tiny shapes)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks.gpu.gpu_check import check_targets, run_gpu_check

BLOCK_OPTIONAL = (
    "import sys, runpy\n"
    "for name in ('datasets', 'gguf', 'bitsandbytes', 'optimum'):\n"
    "    sys.modules[name] = None  # absent on the GPU image: importing them must not be needed\n"
    "sys.argv = ['gpu_check', *sys.argv[1:]]\n"
    "runpy.run_module('benchmarks.gpu.gpu_check', run_name='__main__')\n"
)


def test_tiny_check_runs_every_section_without_optional_packages(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-c", BLOCK_OPTIONAL, "--out", str(tmp_path), "--tiny", "--budget-s", "600"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not result.get("errors") and not result.get("skipped")
    assert "bitsandbytes" not in result["backends"] and "torch" in result["backends"]
    assert all(row["ok"] for row in result["correctness"])
    assert {r["backend"] for r in result["kernels"]} >= {"bf16", "torch"}
    assert [r["draft_tokens"] for r in result["verify_bf16"]] == list(range(1, 9))
    assert [r["draft_tokens"] for r in result["verify_w8a8"]] == list(range(1, 9))
    assert set(result["end_to_end"]) == {"bf16_generate", "bf16_verify_ngram", "quasar_ngram"}
    assert result["model"]["bytes_read_per_step_w8a8"] < result["model"]["bytes_read_per_step_bf16"]
    # q, k, v, o, gate, up, down per layer; q/k/v and gate/up each one stacked linear with its norm
    assert result["quantized_linears"] == {"projections": 2 * 7, "fused_groups": 2 * 2, "w8a8_modules": 2 * 4}
    for label in ("bf16", "w8a8"):  # compiled (Inductor on CPU): both step shapes, quasar = plain token for token
        assert [r["tokens"] for r in result[f"compiled_steps_{label}"]] == [1, 6]
        assert all(r["compiled_ms"] > 0 and r["floor_ms"] > 0 for r in result[f"compiled_steps_{label}"])
        assert result[f"compiled_end_to_end_{label}"]["quasar_equals_plain"] is True, label
    user = result["user_path"]  # from_pretrained quantization, save/reload, generate: exact in every mode and batch
    assert user["ok"] and user["save_reload"]["identical_logits"] is True, user
    assert user["quantize"]["calibrated_on"] == "cpu"
    assert set(user["generate"]) == {f"{m}_{b}" for m in ("eager", "compiled") for b in ("batch1", "batch2_left_padded")}
    assert all(len(row["equal_rows"]) == (2 if "batch2" in name else 1) for name, row in user["generate"].items())
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## What a user does first" in md
    assert "## Verify step (W8A8)" in md and "## Targets" in md
    assert "## Static-cache steps, eager vs compiled (W8A8)" in md
    for label in ("bf16", "w8a8"):
        profile = result[f"profile_{label}"]
        assert profile["device_kernels"] is None and profile["aten_ops"] > 0 and profile["host_ms_profiled"] > 0, profile
    ops = result["profile_w8a8"]["quasar_ops"]
    w8a8_calls = sum(op["calls"] for name, op in ops.items() if name.startswith("quasar::w8a8"))
    assert w8a8_calls == result["quantized_linears"]["w8a8_modules"], f"one op call per W8A8 linear in the profiled step: {ops}"
    assert "## One eager 6-token verify step, profiled (W8A8)" in md


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernel_under_interpreter_matches_reference():
    code = (
        "from benchmarks.gpu.gpu_check import check_correctness\n"
        "rows = check_correctness('cpu', True, ['triton'])\n"
        "assert len(rows) == 3 and all(r.get('ok') for r in rows), rows\n"
        "assert all(r['max_rel_err'] == 0.0 for r in rows), rows\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=dict(os.environ, TRITON_INTERPRET="1")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_exhausted_budget_skips_sections_but_still_writes_reports(tmp_path):
    result = run_gpu_check(str(tmp_path), tiny=True, budget_s=0.0)
    assert {"bandwidth", "correctness", "kernels", "model"} <= set(result["skipped"])
    assert (tmp_path / "gpu_check.json").exists() and (tmp_path / "gpu_check.md").exists()


def test_check_targets_reads_triton_rows_verify_and_end_to_end():
    result = {
        "kernels": [
            {
                "shape": "qwen3-8b.q_proj",
                "M": m,
                "backend": "triton",
                "time_us": 1.0,
                "speedup_vs_bf16": 2.0 - m / 100,
                "fraction_of_copy_bw": 0.8,
            }
            for m in (1, 16, 64)
        ],
        "verify_bf16": [{"draft_tokens": 1, "ms": 10.0}, {"draft_tokens": 2, "ms": 12.0}],
        "verify_w8a8": [{"draft_tokens": 1, "ms": 5.0}, {"draft_tokens": 2, "ms": 8.0}],
        "end_to_end": {"bf16_verify_ngram": {"tokens_per_s_median": 100.0}, "quasar_ngram": {"tokens_per_s_median": 150.0}},
    }
    targets = check_targets(result)
    assert targets["triton_min_speedup_m_le_16 (target >= 1.7)"] == pytest.approx(1.84)
    assert targets["verify_step_min_speedup (target >= 1.6)"] == pytest.approx(1.5)
    assert targets["end_to_end_speedup_vs_bf16_verify (target >= 1.4)"] == pytest.approx(1.5)


def test_full_size_without_cuda_says_how_to_run(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the full check would run")
    with pytest.raises(RuntimeError, match="--tiny"):
        run_gpu_check(str(tmp_path), tiny=False)
