"""`python -m benchmarks serve-shapes --tiny`: the three load shapes' mechanics on a tiny checkpoint (every request
answered and counted, the report written), and the pure helpers behind its figures on hand-made numbers."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from benchmarks.serve import load_shapes
from benchmarks.serve.serve_clients import Outcome


def outcome(started: float, first: float | None, ended: float | None, tokens: int, error: str | None = None) -> Outcome:
    return Outcome("p", started, first_token=first, ended=ended, tokens=tokens, error=error)


def test_counts_take_errors_and_unfinished_requests_as_failed():
    done, broken, running = outcome(0.0, 0.5, 2.0, 16), outcome(0.0, None, None, 0, "HTTP 500: b''"), outcome(1.0, 1.2, None, 0)
    summary = load_shapes.counts([done, broken, running, None])
    assert summary == {
        "requests": 4,
        "failed": 3,
        "errors": ["HTTP 500: b''", "still running at the deadline"],
        "tokens": 16,
    }
    assert load_shapes.latencies([done, broken, None]) == [2.0] and load_shapes.first_token_times([done, running]) == [0.5]


def test_inter_token_time_ratio_and_median_on_hand_made_numbers():
    assert load_shapes.inter_token_s(outcome(0.0, 0.4, 1.0, 7)) == pytest.approx(0.1)  # 6 gaps in 0.6 s
    assert load_shapes.inter_token_s(outcome(0.0, 0.4, 0.4, 1)) is None
    assert load_shapes.ratio(3.0, 1.5) == 2.0 and load_shapes.ratio(None, 1.0) is None and load_shapes.ratio(1.0, 0.0) is None
    assert load_shapes.median([3.0, 1.0, 2.0, 10.0]) == 2.5 and load_shapes.median([]) is None
    row = load_shapes.arrival_row(outcome(5.0, 5.25, 6.0, 8), 1.0)
    assert row == {"sent_s": 1.0, "ttft_s": 0.25, "latency_s": 1.0, "tokens": 8}
    assert load_shapes.arrival_row(None, 1.5)["ttft_s"] is None


def test_prompts_are_distinct_chat_messages():
    prompts = list(itertools.islice(load_shapes.natural_prompts(12), 300))
    texts = [p[0]["content"] for p in prompts]
    assert len(set(texts)) == 300 and all(p[0]["role"] == "user" and len(p) == 1 for p in prompts)
    assert texts[0].startswith(load_shapes.TASKS[0]) and len(texts[0].split(":", 1)[1].split()) == 12


def test_unknown_shapes_are_a_usage_error():
    with pytest.raises(SystemExit):
        load_shapes.parse_args(["--shapes", "mixed,bursts", "--out", "x"])
    assert load_shapes.parse_args(["--shapes", "sampled", "--out", "x"]).shapes == ["sampled"]


def test_tiny_run_answers_every_request_of_every_shape(tmp_path, monkeypatch):
    pytest.importorskip("fastapi", reason="serving needs transformers[serving]")
    monkeypatch.setenv("QUASAR_HF_CACHE", str(tmp_path / "cache"))  # the server's child inherits it
    argv = ["--tiny", "--duration", "3", "--interval", "0.5", "--long-tokens", "24", "--short-tokens", "4"]
    argv += ["--sampled-requests", "2", "--sampled-tokens", "16", "--arrival-tokens", "16", "--repeats", "2", "--mix-waves", "1"]
    json_path, markdown_path = load_shapes.main([*argv, "--out", str(tmp_path / "out")])
    report = json.loads(open(json_path).read())
    assert "environment" in report and report["prompt_tokens"] > 40 and list(report["servers"]) == ["quasar"]
    run = report["servers"]["quasar"]

    mixed = run["mixed"]
    assert mixed["failed"] == 0 and mixed["alone"]["requests"] == 2
    assert mixed["short"]["requests"] == mixed["long"]["requests"] == 4
    assert 0 < mixed["short"]["tokens"] <= 4 * 4 and 0 < mixed["long"]["tokens"] <= 4 * 24
    assert mixed["short_mix_over_alone"] > 0 and mixed["tokens_per_s"] > 0

    arrivals = run["arrivals"]
    assert arrivals["failed"] == 0 and arrivals["requests"] == 6 and arrivals["alone"]["requests"] == 2
    assert [row["sent_s"] for row in arrivals["rows"]] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5], abs=0.1)
    assert all(row["ttft_s"] is not None and row["latency_s"] >= row["ttft_s"] for row in arrivals["rows"])
    assert arrivals["alone"]["ttft_s"] > 0 and arrivals["alone"]["step_s"] > 0
    assert arrivals["ttft_p50_over_target"] > 0 and arrivals["ttft_p90_s"] >= arrivals["ttft_p50_s"]

    sampled = run["sampled"]
    assert sampled["failed"] == 0 and sampled["four_over_one"] > 0
    assert sampled["levels"]["1"]["requests"] == 2 and sampled["levels"]["4"]["requests"] == 8
    assert all(0 < level["tokens"] <= level["requests"] * 16 for level in sampled["levels"].values())

    markdown = open(markdown_path).read()
    assert markdown.count("| quasar |") == 3 and "| quasar | 6 |" in markdown and "Environment: {'python'" in markdown
    assert not (tmp_path / "cache" / "served").exists(), "the tiny checkpoint is made in --out, not cached"


def test_markdown_names_a_skipped_server_and_only_the_shapes_run():
    level = {"requests": 2, "failed": 0, "errors": [], "tokens": 128, "wall_s": 1.0}
    sampled = {"levels": {"1": {**level, "tokens_per_s": 50.0}, "4": {**level, "tokens_per_s": 150.0}}, "four_over_one": 3.0}
    settings = {"temperature": 0.7, "top_p": 0.8, "sampled_tokens": 64, "sampled_requests": 2}
    result = {"command": "c", "prompt_tokens": 90, "settings": settings}
    result["servers"] = {"quasar": {"sampled": {**sampled, "failed": 0}}, "llama_server": {"skipped": "llama-server exited"}}
    markdown = load_shapes.to_markdown(result)
    assert "| quasar | 50.000 | 150.000 | 3.000 | 0 |" in markdown and "- llama_server: skipped (llama-server exited)" in markdown
    assert "Mixed" not in markdown and "Arrivals" not in markdown


def test_a_request_due_past_its_shapes_deadline_is_not_sent_and_fails():
    past = load_shapes.Budget(request_s=600.0, deadline=time.monotonic() - 1)
    late = load_shapes.ask(1, "m", [{"role": "user", "content": "hi"}], 4, {}, past)  # port 1: nothing is sent
    assert late.error.startswith("not sent") and load_shapes.counts([late])["failed"] == 1
    assert load_shapes.Budget(600.0, time.monotonic() + 30).socket_timeout() == pytest.approx(30, abs=1)
    assert load_shapes.Budget(5.0, time.monotonic() + 30).socket_timeout() == 5.0
