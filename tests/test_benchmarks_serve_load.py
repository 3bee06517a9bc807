"""`python -m benchmarks serve-load --tiny`: the load run's mechanics on a tiny checkpoint (servers started
and stopped, every request answered and compared with offline decoding, the report written)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="serving needs transformers[serving]")


def test_serve_load_runs_our_server_and_transformers_serve_and_reports_every_level(tmp_path, monkeypatch):
    from benchmarks.serve import serve_load

    monkeypatch.setenv("QUASAR_HF_CACHE", str(tmp_path / "cache"))  # the servers' children inherit it

    argv = ["--tiny", "--servers", "quasar,bf16,llamacpp", "--levels", "1,2", "--requests", "4", "--max-tokens", "12"]
    argv += ["--scrape-metrics", "0.05", "--rounds", "2"]
    paths = serve_load.main([*argv, "--out", str(tmp_path)])
    report = json.loads(open(paths[0]).read())
    servers = report["models"]["tiny"]["servers"]
    for name in ("quasar", "quasar_off", "bf16"):
        for level in servers[name]["levels"].values():
            assert level["failed"] == 0 and level["tokens"] > 0 and level["tokens_per_s"] > 0
    for name in ("quasar", "quasar_off", "quasar_scraped"):
        for level in servers[name]["levels"].values():
            assert level["equal_to_offline"] == 8 and level["all_near_ties"]  # 4 requests in each of 2 rounds
            assert len(level["tokens_per_s_by_round"]) == 2
        assert servers[name]["peak_rss_mb"] > 0
    scraped = servers["quasar_scraped"]["levels"].values()
    assert sum(level["scrapes"] for level in scraped) > 0 and all(level["failed_scrapes"] == 0 for level in scraped)
    assert "skipped" in servers["llamacpp"] and "environment" in report
    markdown = open(paths[1]).read()
    assert "| quasar | 2 |" in markdown and "quasar_scraped at 2 clients:" in markdown
    assert "quasar over quasar_off at 2 clients, round by round: " in markdown and "Environment: {'python'" in markdown
    assert not (tmp_path / "cache" / "served").exists(), "the tiny checkpoint is quantized in --out, not cached"


def test_serve_profile_splits_each_modes_time_and_reads_the_served_rows(tmp_path):
    from benchmarks.serve import serve_load, serve_profile

    _, checkpoint = serve_load.tiny_checkpoints(tmp_path)
    served = {"models": {checkpoint: {"servers": {"quasar": {"levels": {"1": {"tokens_per_s": 12.5}}}}}}}
    (tmp_path / "load.json").write_text(json.dumps(served))
    argv = ["--model", checkpoint, "--requests", "3", "--max-tokens", "8", "--modes", "eager-plain,eager-auto,eager-ngram"]
    paths = serve_profile.main([*argv, "--serve-load", str(tmp_path / "load.json"), "--out", str(tmp_path), "--name", "p"])
    report = json.loads(open(paths[0]).read())
    assert set(report["modes"]) == {"eager-plain", "eager-auto", "eager-ngram"} and report["floor"]["ms"] > 0
    assert report["modes"]["eager-plain"]["tokens"] == 3 * 8 and "forwards_per_token" not in report["modes"]["eager-plain"]
    ngram = report["modes"]["eager-ngram"]
    shares = ngram["prefill_share"] + ngram["draft_share"] + ngram["forward_share"] + ngram["loop_share"]
    assert abs(shares - 1) < 0.01 and 0 < ngram["forwards_per_token"] <= 1
    assert "| 12.500 |" in open(paths[1]).read()  # the served row beside its mode (3 decimals)
