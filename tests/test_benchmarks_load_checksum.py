"""`python -m benchmarks load-checksum` on a tiny shape: a report with both timings and every tensor checked."""

from __future__ import annotations

import json

from benchmarks.speed import load_checksum


def test_load_checksum_reports_check_and_read_times(tmp_path, monkeypatch):
    monkeypatch.setattr(load_checksum, "SHAPES", [("tiny", 2, 64, 128, 32, 100)])
    paths = load_checksum.main(["--rounds", "1", "--out", str(tmp_path), "--name", "checksum"])
    report = json.loads(open(paths[0]).read())
    (row,) = report["rows"]
    assert row["tensors_checked"] == 1 + 2 * (7 * 2 + 2) and row["check_gb_per_s"] > 0
    assert report["environment"] and "| tiny |" in open(paths[1]).read()
