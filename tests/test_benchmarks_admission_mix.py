"""The admission-mix benchmark's mechanics on the tiny checkpoint: every policy and round gets a row, the report
its JSON with an environment block and a table (speed is measured by the benchmark, never asserted here)."""

import json

from benchmarks.__main__ import main as benchmarks_main
from tests.helpers.hub import saved_quasar_tiny


def test_every_policy_and_round_gets_a_row_and_the_report_a_table(tmp_path):
    checkpoint = saved_quasar_tiny(tmp_path / "quasar", tmp_path / "base")
    argv = ["admission-mix", "--quantized", str(checkpoint), "--rounds", "2", "--waves", "1", "--clients", "4"]
    argv += ["--short-tokens", "3", "--long-tokens", "20", "--prompt-words", "12", "--out", str(tmp_path / "out")]
    assert benchmarks_main(argv) == 0
    report = json.loads((tmp_path / "out" / "admission_mix.json").read_text())
    assert len(report["rows"]) == 2 * 4 and {row["round"] for row in report["rows"]} == {1, 2}
    assert all(row["short_p50_s"] > 0 and row["long_p50_s"] > 0 for row in report["rows"])
    assert "environment" in report and "python" in report["environment"]
    table = (tmp_path / "out" / "admission_mix.md").read_text()
    assert table.count("| 1 | ") == 4 and "hold from 2 rows (default)" in table
