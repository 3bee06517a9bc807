"""The vLLM load check: token comparison, and the export + skip path on a machine without vLLM/CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import vllm_check


def test_first_difference_and_compare():
    assert vllm_check.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert vllm_check.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert vllm_check.first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early
    report = vllm_check.compare([[1, 2], [3, 4]], [[1, 2], [3, 5]])
    assert report == {"identical_prompts": 1, "prompts": 2, "first_difference": [None, 1]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without CUDA")
def test_tiny_run_exports_decodes_and_says_why_serving_was_skipped(tmp_path):
    assert vllm_check.main(["--tiny", "--max-new-tokens", "6", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "vllm_check.json").read_text())
    assert result["export"]["quantized_modules"] > 0
    assert len(result["transformers_quasar_tokens"]) == len(vllm_check.PROMPTS)
    assert all(1 <= len(t) <= 6 for t in result["transformers_quasar_tokens"])  # EOS may come first
    assert result["vllm"] == {"skipped": "no CUDA device"}
    assert "skipped: no CUDA device" in (tmp_path / "vllm_check.md").read_text()
