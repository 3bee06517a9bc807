"""What the kernel-build benchmarks (`lm-head`, `attention-kernel`) share: option checks and report files."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Callable

from quasar_hf.bench.report import environment


def selected_shapes(parser: argparse.ArgumentParser, shapes: list[tuple], labels: list[str] | None) -> list[tuple]:
    """The SHAPES whose label is in `labels` (all for None); a parser error naming the choices if none."""
    chosen = [s for s in shapes if labels is None or s[0] in labels]
    if not chosen:
        parser.error(f"--shapes: choose among {[s[0] for s in shapes]}")
    return chosen


def check_baselines(parser: argparse.ArgumentParser, baselines: list[str] | None) -> None:
    """A parser error naming the first --baseline that is not a file."""
    missing = [path for path in baselines or () if not os.path.isfile(path)]
    if missing:
        parser.error(f"--baseline: no such file {missing[0]!r}")


def write_build_reports(
    result: dict, out: str, name: str, prog: str, argv: list[str] | None, to_markdown: Callable[[dict, str], str]
) -> list[str]:
    """Add the environment and the command to `result`, write out/NAME.json and NAME.md; their paths."""
    result["environment"] = environment()
    result["command"] = f"{prog} {shlex.join(argv if argv is not None else sys.argv[1:])}".strip()
    os.makedirs(out, exist_ok=True)
    json_path, md_path = (os.path.join(out, f"{name}.{ext}") for ext in ("json", "md"))
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(md_path, "w") as f:
        f.write(to_markdown(result, result["command"]))
    return [json_path, md_path]
