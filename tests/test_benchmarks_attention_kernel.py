"""`python -m benchmarks attention-kernel`: builds checked, timed side by side, reports written."""

import json

import pytest

from benchmarks.kernels import attention_kernel
from quasar_hf.ops.c_build import CSRC, missing_cpu_flags

pytestmark = [
    pytest.mark.kernels("attention"),
    pytest.mark.skipif(
        bool(missing_cpu_flags(("avx2", "fma"))),
        reason="needs the row-stable attention kernel and a CPU with AVX2 and FMA (the builds it times)",
    ),
]


def test_report_times_every_build_and_the_baseline(tmp_path):
    argv = ["--out", str(tmp_path), "--name", "ak", "--shapes", "SmolLM2-135M", "--rows", "1", "3", "--samples", "1"]
    argv += ["--slots", "32", "--written", "20", "--layers", "2", "--baseline", str(CSRC / "rowstable_attention.c")]
    json_path, md_path = attention_kernel.main(argv)
    result = json.loads(open(json_path).read())
    kernels = {r["kernel"] for r in result["results"]}
    assert kernels and len(result["results"]) == 2 * len(kernels)
    assert any("(baseline)" in name for name in kernels)
    for r in result["results"]:
        assert r["us"] > 0
        if "(baseline)" not in r["kernel"]:
            assert r["vs_current"] == 1.0
    assert "attention-kernel" in open(md_path).read()


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        attention_kernel.main(["--out", str(tmp_path), "--rows", "400"])
    with pytest.raises(SystemExit):
        attention_kernel.main(["--out", str(tmp_path), "--baseline", str(tmp_path / "missing.c")])
