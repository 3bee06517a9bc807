"""`python -m benchmarks hadamard-kernel`: every build checked against the oracle, timed side by side, reports written."""

import json

import pytest

from benchmarks.kernels import c_kernels, hadamard_kernel
from quasar_hf.ops.c_build import CSRC

pytestmark = pytest.mark.kernels("hadamard")


def test_report_times_every_build_this_cpu_runs_and_a_baseline(tmp_path):
    argv = ["--out", str(tmp_path), "--name", "hk", "--shapes", "SmolLM2-135M", "--rows", "1", "3", "--samples", "1"]
    json_path, md_path = hadamard_kernel.main([*argv, "--layers", "2", "--baseline", str(CSRC / "hadamard_rows.c")])
    result = json.loads(open(json_path).read())
    runnable = [source for _, source, _ in c_kernels.runnable_builds("hadamard")]
    assert "hadamard_rows.c" in runnable  # the portable build runs everywhere
    assert result["builds"] == [*runnable, "hadamard_rows.c (baseline)"]
    assert len(result["results"]) == 2 * len(result["builds"])
    for r in result["results"]:
        assert r["us"] > 0 and r["rotation"] == "1 x H_12 (x) H_128"
        assert (r["vs_fastest"] == 1.0) == (r["build"] == runnable[0])
    assert "hadamard-kernel" in open(md_path).read()


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        hadamard_kernel.main(["--out", str(tmp_path), "--rows", "0"])
    with pytest.raises(SystemExit):
        hadamard_kernel.main(["--out", str(tmp_path), "--shapes", "GPT-9"])
    with pytest.raises(SystemExit):
        hadamard_kernel.main(["--out", str(tmp_path), "--baseline", str(tmp_path / "missing.c")])
