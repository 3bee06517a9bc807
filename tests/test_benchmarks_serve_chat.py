"""`python -m benchmarks serve-chat` on a tiny checkpoint: later turns reuse the history with the cache and
nothing without it, and the report holds both servers' turns and the shared-system-prompt shape."""

from __future__ import annotations

import json

import pytest

from benchmarks.serve import chat_turns
from tests.helpers.hub import saved_quasar_tiny

pytest.importorskip("fastapi", reason="serving needs transformers[serving]")
pytest.importorskip("prometheus_client", reason="/metrics needs prometheus_client")


def test_a_short_chat_run_reports_reuse_with_the_cache_only(tmp_path):
    checkpoint = saved_quasar_tiny(tmp_path / "tiny-quasar", tmp_path / "base")
    argv = ["--model", str(checkpoint), "--turns", "2", "--words", "20", "--max-tokens", "8", "--clients", "2", "--waves", "2"]
    json_path, markdown_path = sorted(chat_turns.main([*argv, "--system-words", "40", "--out", str(tmp_path / "out")]))
    runs = json.loads(open(json_path).read())["runs"]
    with_cache, without = runs["cache"]["multi_turn"], runs["no_cache"]["multi_turn"]
    assert [t["turn"] for t in with_cache] == [1, 2] and with_cache[0]["reused"] == 0
    assert with_cache[1]["prompt_tokens"] > with_cache[0]["prompt_tokens"] > 20
    assert with_cache[0]["prompt_tokens"] < with_cache[1]["reused"] < with_cache[1]["prompt_tokens"]
    assert all(t["reused"] == 0 for t in without) and all(w["reused"] == 0 for w in runs["no_cache"]["shared_system_prompt"])
    first_wave, second_wave = runs["cache"]["shared_system_prompt"]
    assert first_wave["reused"] == 0 and second_wave["reused"] > 0  # the second wave's rows continue from the first's
    assert "| 2 |" in open(markdown_path).read() and "Environment: {'python'" in open(markdown_path).read()
