"""The scheduler-profile benchmark's mechanics on the tiny checkpoint: each client count gets its tokens/s, its steps
split by width and its prefills, the report a JSON with an environment block and a table (speed is measured by the
benchmark, never asserted here)."""

import json

import pytest

from benchmarks.__main__ import main as benchmarks_main
from benchmarks.serve.scheduler_profile import StepTimes, steps_only_ratio
from quasar_hf.speculative.stats import QuasarStats
from tests.helpers.hub import saved_quasar_tiny


@pytest.mark.parametrize("mode", ["sampled", "greedy"])
def test_each_client_count_gets_its_steps_by_width_and_its_prefills(tmp_path, mode):
    checkpoint = saved_quasar_tiny(tmp_path / "quasar", tmp_path / "base")
    argv = ["scheduler-profile", "--quantized", str(checkpoint), "--mode", mode, "--clients", "1", "2"]
    argv += ["--requests-per-client", "2", "--max-tokens", "6", "--out", str(tmp_path / "out")]
    assert benchmarks_main(argv) == 0
    report = json.loads((tmp_path / "out" / "scheduler_profile.json").read_text())
    one, two = report["levels"]
    assert one["clients"] == 1 and two["clients"] == 2 and one["tokens_per_s"] > 0 and two["tokens_per_s"] > 0
    assert one["prefills"] == 2 and two["prefills"] == 4  # every request prefilled once, none of the warm-up's
    assert set(one["steps"]) == {"1"} and set(two["steps"]) <= {"1", "2"}
    assert all(step["steps"] > 0 and step["forward_ms"] > 0 for level in (one, two) for step in level["steps"].values())
    assert report["mode"] == mode and "python" in report["environment"]
    assert "| 1 | " in (tmp_path / "out" / "scheduler_profile.md").read_text()


def test_step_times_split_each_step_by_its_rows_and_the_ratio_uses_the_full_steps():
    times = StepTimes()
    times(QuasarStats(prefill_time_s=0.05), 0)
    times(QuasarStats(forward_time_s=0.010, verify_time_s=0.012, draft_time_s=0.001), 1)
    times(QuasarStats(forward_time_s=0.020, verify_time_s=0.026, draft_time_s=0.002), 4)
    summary = times.summary()
    assert summary["prefills"] == 1 and summary["prefill_ms"] == 50.0
    assert summary["steps"]["4"] == {"steps": 1, "forward_ms": 20.0, "rest_of_step_ms": 6.0, "draft_ms": 2.0}
    levels = [{"clients": 1, "steps": {"1": summary["steps"]["1"]}}, {"clients": 4, "steps": summary["steps"]}]
    ratio, note = steps_only_ratio(levels)
    assert ratio == round(4 * 13 / 28, 2) and "4 rows per 28.0 ms" in note
    times.reset()
    assert times.summary() == {"steps": {}, "prefills": 0, "prefill_ms": None}
