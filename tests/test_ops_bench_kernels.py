"""The kernel micro-benchmark runs end to end on tiny shapes and writes consistent reports (no speed asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks.kernels import kernels


@pytest.fixture(scope="module")
def result():
    return kernels.run_kernel_benchmark(
        "cpu", shapes=[("tiny 64x48", 64, 48)], ms=[1, 3], backends=["torch", "reference"], samples=2, copy_mebibytes=4
    )


def test_rows_cover_every_shape_m_and_backend(result):
    keys = {(r["M"], r["backend"]) for r in result["rows"]}
    assert keys == {(m, b) for m in (1, 3) for b in ("bf16", "torch", "reference")}
    for row in result["rows"]:
        assert row["K"] == 64 and row["N"] == 48 and row["time_us"] > 0 and row["gbps"] > 0
        expected_bytes = 48 * 64 * (2 if row["backend"] == "bf16" else 1) + row["M"] * 64 * 2
        assert row["gbps"] == pytest.approx(expected_bytes / (row["time_us"] * 1e-6) / 1e9)
        assert row["fraction_of_copy_bw"] == pytest.approx(row["gbps"] / result["copy_gbps"])
    assert result["copy_gbps"] > 0 and result["environment"]["device"] == "cpu"


def test_reports_hold_every_backend(result, tmp_path):
    md = kernels.write_markdown(result, tmp_path / "k.md").read_text()
    assert "| M | bf16 | torch | reference |" in md and md.count("\n| 3 |") == 1
    loaded = json.loads(kernels.write_json(result, tmp_path / "k.json").read_text())
    assert loaded["rows"] == json.loads(json.dumps(result["rows"]))


def test_copies_push_the_working_set_past_the_cache():
    import torch

    small = kernels._copies_needed(576 * 192, torch.device("cpu"))
    assert small * 576 * 192 >= 96 * 2**20 or small == 1024
    assert kernels._copies_needed(4096 * 14336, torch.device("cpu")) == 2


def test_cli_rejects_unknown_shape_prefix():
    from benchmarks.kernels.kernels import main

    with pytest.raises(SystemExit, match="no shape matches"):
        main(["--shapes", "gpt5", "--out", "/nonexistent"])
