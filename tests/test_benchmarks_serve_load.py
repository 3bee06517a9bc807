"""`python -m benchmarks serve-load --tiny`: the load run's mechanics on a tiny checkpoint (servers started
and stopped, every request answered and compared with offline decoding, the report written)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="serving needs transformers[serving]")


def test_serve_load_runs_our_server_and_transformers_serve_and_reports_every_level(tmp_path):
    from benchmarks.serve import serve_load

    argv = ["--tiny", "--servers", "quasar,bf16,llamacpp", "--levels", "1,2", "--requests", "4", "--max-tokens", "12"]
    paths = serve_load.main([*argv, "--out", str(tmp_path)])
    report = json.loads(open(paths[0]).read())
    servers = report["models"]["tiny"]["servers"]
    for name in ("quasar", "quasar_off", "bf16"):
        for level in servers[name]["levels"].values():
            assert level["failed"] == 0 and level["tokens"] > 0 and level["tokens_per_s"] > 0
    for name in ("quasar", "quasar_off"):
        for level in servers[name]["levels"].values():
            assert level["equal_to_offline"] == 4 and level["all_near_ties"]
        assert servers[name]["peak_rss_mb"] > 0
    assert "skipped" in servers["llamacpp"] and "environment" in report
    assert "| quasar | 2 |" in open(paths[1]).read()
