"""lm-eval integration: QuasarLM generates exactly what lm-eval's HF model generates with the W8A8
model, and the offline tiny tasks run end to end (tiny random models, char tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig, is_quasar_model
from quasar_hf.commands.loading import UsageError
from quasar_hf.eval.lm_eval_model import QuasarLM
from quasar_hf.eval.lm_eval_runner import compare_tasks, eval_main, to_markdown
from quasar_hf.eval.stopping import RowStopSequences
from quasar_hf.eval.tasks import LOCAL_TASKS, load_task_yaml, task_specs
from tests.helpers.tiny_models import char_tokenizer, save_tiny

FAST = dict(num_calibration_samples=4, calibration_seq_len=64)
PROMPTS = ["abcabcabcabcab", "Word: river\nRepeat: river\nWord: river\nRepeat:", "1 2 3 1 2 3 1 2 3 1"]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(W8A8 model, fp32 reference, tokenizer, source folder) of one tiny random Llama."""
    folder = save_tiny(tmp_path_factory.mktemp("tiny") / "src")
    quantized = AutoModelForCausalLM.from_pretrained(folder, quantization_config=QuasarConfig(**FAST), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return quantized.eval(), reference.eval(), char_tokenizer(), folder


def requests(prompts, until, max_gen_toks=24):
    kwargs = {"until": until, "max_gen_toks": max_gen_toks, "do_sample": False}
    return [Instance("generate_until", {}, (p, dict(kwargs)), idx=i) for i, p in enumerate(prompts)]


def test_generate_until_equals_lm_eval_hf_on_the_w8a8_model(tiny_pair):
    quantized, _, tokenizer, _ = tiny_pair
    assert is_quasar_model(quantized)
    plain = HFLM(pretrained=quantized, tokenizer=tokenizer, batch_size=1)
    quasar = QuasarLM(pretrained=quantized, tokenizer=tokenizer, batch_size=1)
    assert quasar.quasar_decoding
    unstopped = plain.generate_until(requests(PROMPTS, []))
    assert quasar.generate_until(requests(PROMPTS, [])) == unstopped
    assert sum(s.verify_steps for s in quasar.quasar_stats) > 0  # the speculative loop really ran
    # Stop strings that occur mid-generation: the text is cut at the same place on both paths.
    stops = [text.split()[3] for text in unstopped if len(text.split()) > 3]
    assert stops, "the tiny model generated too little text to pick stop strings from"
    stopped = plain.generate_until(requests(PROMPTS, stops))
    assert quasar.generate_until(requests(PROMPTS, stops)) == stopped
    assert any(len(a) < len(b) for a, b in zip(stopped, unstopped))


def test_batched_quasar_generation_equals_plain_batched_generation(tiny_pair):
    quantized, _, tokenizer, _ = tiny_pair
    plain = QuasarLM(pretrained=quantized, tokenizer=tokenizer, batch_size=3, quasar=False)
    quasar = QuasarLM(pretrained=quantized, tokenizer=tokenizer, batch_size=3)
    assert not plain.quasar_decoding and quasar.quasar_decoding
    assert quasar.generate_until(requests(PROMPTS, ["\n"])) == plain.generate_until(requests(PROMPTS, ["\n"]))


def test_unquantized_model_generates_plainly(tiny_pair):
    _, reference, tokenizer, _ = tiny_pair
    lm = QuasarLM(pretrained=reference, tokenizer=tokenizer, batch_size=1)
    assert not lm.quasar_decoding
    assert lm.generate_until(requests(PROMPTS[:1], [])) == HFLM(pretrained=reference, tokenizer=tokenizer).generate_until(
        requests(PROMPTS[:1], [])
    )


def test_row_stop_sequences_answer_per_row():
    tokenizer = char_tokenizer()
    ids = torch.tensor([tokenizer.encode("xxab"), tokenizer.encode("xxba")])  # prompt "xx", generated "ab" / "ba"
    criterion = RowStopSequences(["a b"], tokenizer, prompt_length=2)  # the char tokenizer decodes with spaces
    assert criterion(ids, None).tolist() == [True, False]
    assert RowStopSequences([], tokenizer, 2)(ids, None).tolist() == [False, False]


def test_local_tasks_run_offline_end_to_end(tiny_pair, tmp_path):
    quantized, reference, tokenizer, _ = tiny_pair
    result = compare_tasks(quantized, reference, tokenizer, list(LOCAL_TASKS), limit=2, plain_w8a8=True)
    rows = {(r["task"], r["metric"]): r for r in result["rows"]}
    assert {("quasar_tiny_mc", "acc,none"), ("quasar_tiny_mc", "acc_norm,none"), ("quasar_tiny_gen", "exact_match,strip")} <= set(
        rows
    )
    for row in rows.values():
        assert 0.0 <= row["reference"] <= 1.0 and 0.0 <= row["quantized"] <= 1.0
        expected = None if row["reference"] == 0 else 100 * row["quantized"] / row["reference"]
        assert row["recovery_pct"] == expected
    quasar = result["variants"]["w8a8_quasar"]
    assert quasar["quasar_decoding"] and quasar["generations_equal_plain_w8a8"] is True
    assert quasar["num_samples"] == {"quasar_tiny_mc": 2, "quasar_tiny_gen": 2}
    assert len(quasar["outputs"]["quasar_tiny_gen"]) == 2
    assert all(v["wall_time_s"] > 0 for v in result["variants"].values())
    assert result["environment"]["versions"]["lm_eval"]
    markdown = to_markdown(result)
    assert "| quasar_tiny_mc | acc,none |" in markdown and "recovery %" in markdown
    json.dumps(result, default=str)


def test_eval_main_on_a_saved_checkpoint_writes_reports_and_records_the_card(tiny_pair, tmp_path):
    quantized, _, tokenizer, source = tiny_pair
    checkpoint = tmp_path / "quasar"
    quantized.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    out = tmp_path / "out"
    argv = [str(checkpoint), "--reference", source, "--tasks", "quasar_tiny_mc", "--limit", "2", "--dtype", "float32"]
    assert eval_main([*argv, "--out", str(out), "--name", "tiny", "--record"]) == 0
    result = json.loads((out / "tiny.json").read_text())
    assert result["models"]["reference"] == source and result["command"].startswith("quasar-hf eval")
    assert (out / "tiny.md").read_text().startswith("# Task accuracy")
    measured = json.loads((checkpoint / "config.json").read_text())["quantization_config"]["measured"]
    assert {row["task"] for row in measured["accuracy"]} == {"quasar_tiny_mc"}
    assert "quasar_tiny_mc" in (checkpoint / "README.md").read_text()


def test_eval_main_refuses_a_quasar_checkpoint_without_reference(tiny_pair, tmp_path):
    quantized, _, tokenizer, _ = tiny_pair
    quantized.save_pretrained(tmp_path / "q")
    with pytest.raises(UsageError, match="--reference"):
        eval_main([str(tmp_path / "q"), "--tasks", "quasar_tiny_mc"])


def test_task_yaml_data_files_resolve_next_to_the_yaml(tmp_path, monkeypatch):
    (tmp_path / "data.jsonl").write_text('{"q": "x", "a": "y"}\n')
    (tmp_path / "mine.yaml").write_text(
        "task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: data.jsonl\noutput_type: generate_until\n"
    )
    monkeypatch.chdir(tmp_path.parent)  # lm-eval alone would look for data.jsonl here
    config = load_task_yaml(tmp_path / "mine.yaml")
    assert config["dataset_kwargs"]["data_files"]["test"] == str(tmp_path / "data.jsonl")
    specs = task_specs(["quasar_tiny_mc", str(tmp_path / "mine.yaml"), "hellaswag"])
    assert specs[0]["task"] == "quasar_tiny_mc" and specs[1]["task"] == "mine" and specs[2] == "hellaswag"
    (tmp_path / "nameless.yaml").write_text("dataset_path: json\n")
    with pytest.raises(UsageError, match="task:"):
        load_task_yaml(tmp_path / "nameless.yaml")
    with pytest.raises(UsageError, match="does not exist"):
        load_task_yaml(tmp_path / "missing.yaml")
    with pytest.raises(UsageError, match="no tasks"):
        task_specs([])


def test_registered_by_name_for_lm_eval(tiny_pair, tmp_path):
    from lm_eval.api.registry import get_model

    quantized, _, tokenizer, _ = tiny_pair
    quantized.save_pretrained(tmp_path / "q")
    tokenizer.save_pretrained(tmp_path / "q")
    assert get_model("quasar-hf") is QuasarLM
    lm = QuasarLM.create_from_arg_string(f"pretrained={tmp_path / 'q'}", {"batch_size": 1, "device": "cpu"})
    assert lm.quasar_decoding and is_quasar_model(lm.model)
    plain = QuasarLM.create_from_arg_string(f"pretrained={tmp_path / 'q'},quasar=False", {"batch_size": 1, "device": "cpu"})
    assert not plain.quasar_decoding
