"""`python -m benchmarks serve-soak` on a tiny checkpoint: every request answered but those that left, the report's
RSS windows and the server's own counters (cancelled rows included)."""

from __future__ import annotations

import json

import pytest

from benchmarks.serve import soak
from tests.helpers.hub import saved_quasar_tiny

pytest.importorskip("fastapi", reason="serving needs transformers[serving]")
pytest.importorskip("prometheus_client", reason="/metrics needs prometheus_client")


def test_a_small_soak_reports_failures_rss_and_the_servers_counters(tmp_path):
    checkpoint = saved_quasar_tiny(tmp_path / "tiny-quasar", tmp_path / "base")
    argv = ["--model", str(checkpoint), "--requests", "24", "--clients", "4", "--leave-every", "4", "--window", "6"]
    paths = soak.main([*argv, "--max-tokens", "3,40", "--out", str(tmp_path / "out")])
    json_path, markdown_path = sorted(paths)
    report = json.loads(open(json_path).read())
    summary = report["summary"]
    assert summary["requests"] == 24 and summary["left_mid_stream"] == 6 and summary["failed"] == 0
    assert report["healthy_after"] and summary["rss_first_mb"] > 0 and "environment" in report
    finished = {k: v for k, v in report["server_metrics"].items() if k.startswith("quasar_requests_finished_total")}
    assert sum(finished.values()) == 24
    assert "| 24 | 4 | 6 | 0 |" in open(markdown_path).read()
