"""The measurement harness: one runner, `python -m benchmarks <measurement> [options]` (from the repo root).

It lives outside the package, as optimum-quanto keeps its bench: these measurements time and
compare the code (steps against their bytes floor, drafters, scaling, fidelity variants, serving,
the GPU check). The code is split by area (quantize, fidelity, speed, kernels, gpu, serve); each
measurement writes a JSON report with an environment block and a markdown table into
`benchmarks/reports/<measurement>/` (`reports_dir`), and `python -m benchmarks.index` makes the
index of them (`benchmarks/reports/README.md`) from the files. What a user runs on their own model
ships in the package: `quasar-hf bench` (Quasar against its peers) and `quasar-hf eval` (fidelity,
lm-eval tasks).
"""

from __future__ import annotations

from pathlib import Path

REPORTS = Path(__file__).resolve().parent / "reports"


def reports_dir(measurement: str) -> str:
    """Where `python -m benchmarks <measurement>` writes its reports by default."""
    return str(REPORTS / measurement)
