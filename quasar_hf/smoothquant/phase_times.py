"""Where quantization time goes: wall seconds per phase, per decoder layer and in total.

`calibration_info["timing"]` keeps the result, `quasar-hf quantize --profile` prints it, and the
progress bar shows the current layer's split.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseTimes:
    """Accumulates wall time by phase name; `start_layer` opens a new per-layer record."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.layers: list[dict[str, float]] = []

    def start_layer(self) -> None:
        self.layers.append({})

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # GPU work was queued: charge it to this phase
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds
        if self.layers:
            self.layers[-1][name] = self.layers[-1].get(name, 0.0) + seconds

    def postfix(self) -> str:
        """The last layer's three largest phases: 'statistics_forward 3.1s, gptq_rounding 1.2s, ...'."""
        last = self.layers[-1] if self.layers else {}
        largest = sorted(last.items(), key=lambda kv: -kv[1])[:3]
        return ", ".join(f"{name} {seconds:.1f}s" for name, seconds in largest)

    def summary(self) -> dict:
        """{"total_s": {phase: s}, "per_layer_s": [{phase: s}, ...]}, rounded to 10 ms."""
        return {
            "total_s": {name: round(s, 2) for name, s in sorted(self.totals.items(), key=lambda kv: -kv[1])},
            "per_layer_s": [{name: round(s, 2) for name, s in layer.items()} for layer in self.layers],
        }


def format_timing(timing: dict) -> str:
    """The `--profile` table: each phase's total seconds and share, largest first."""
    totals = timing.get("total_s") or {}
    whole = sum(totals.values()) or 1.0
    lines = ["phase                     seconds   share"]
    for name, seconds in totals.items():
        lines.append(f"{name:<24}{seconds:>9.2f}  {100 * seconds / whole:5.1f} %")
    layers = timing.get("per_layer_s") or []
    if layers:
        per_layer = [sum(layer.values()) for layer in layers]
        lines.append(f"per decoder layer: {min(per_layer):.2f}-{max(per_layer):.2f} s ({len(layers)} layers)")
    return "\n".join(lines)
