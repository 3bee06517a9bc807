"""The scrape-cost benchmark's mechanics on the tiny checkpoint: a served, warmed server's /metrics parses, and the
report gives the server's CPU per scrape with an environment block (its size is measured, never asserted)."""

import json

from benchmarks.__main__ import main as benchmarks_main


def test_a_tiny_run_reports_the_servers_cpu_per_scrape(tmp_path):
    argv = ["scrape-cost", "--tiny", "--scrapes", "20", "--requests", "2", "--idle-s", "0.5", "--out", str(tmp_path)]
    assert benchmarks_main(argv) == 0
    report = json.loads((tmp_path / "scrape_cost.json").read_text())
    result = report["result"]
    assert result["scrapes"] == 20 and result["metric_families"] > 5
    assert result["server_cpu_ms_per_scrape"] >= 0 and result["wall_ms_per_scrape"] > 0
    assert abs(result["share_at_most"] - result["server_cpu_ms_per_scrape"] / 1e3) < 1e-4  # one scrape per second
    assert "environment" in report and "server CPU ms per scrape" in (tmp_path / "scrape_cost.md").read_text()
