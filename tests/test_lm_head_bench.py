"""benchmarks/kernels/lm_head.py on a tiny shape: every build here plus F.linear (and baseline builds) get a row."""

import pytest

from benchmarks.kernels import lm_head
from benchmarks.kernels.lm_head import VARIANTS
from quasar_hf.ops.c_build import CSRC, missing_cpu_flags


@pytest.mark.kernels("rowstable_linear")
def test_every_build_and_torch_get_a_row_and_a_table(tmp_path):
    baselines = []
    for name, source in (("baseline_avx2.c", "rowstable_linear_avx2.c"), ("baseline_avx512.c", "rowstable_linear.c")):
        baselines.append(tmp_path / name)
        baselines[-1].write_text((CSRC / source).read_text())
    result = lm_head.measure([("tiny", 70, 40)], (1, 3), samples=1, baselines=[str(b) for b in baselines], working_set=1)
    kernels = {r["kernel"] for r in result["results"]}
    assert "F.linear (torch)" in kernels and "baseline_avx2 (baseline)" in kernels and len(kernels) >= 3
    wide = not missing_cpu_flags(VARIANTS[0][2])  # an AVX-512 baseline is built where AVX-512 runs
    assert ("baseline_avx512 (baseline)" in kernels) == wide
    assert {r["rows"] for r in result["results"]} == {1, 3}
    assert all(r["ms"] > 0 and r["x_floor"] > 0 for r in result["results"])
    result["environment"] = {}
    assert "| tiny | 3 | F.linear (torch) |" in lm_head.to_markdown(result, "cmd")
