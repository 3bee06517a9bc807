"""`python -m benchmarks per-layer-compare A.json B.json`: two per-layer reports of one model side by
side (for example SmoothQuant alone vs with the Hadamard rotation), per linear kind and per layer
for the kinds asked (default down_proj and o_proj): SQNR both / act-only / weight-only, and the
change in dB.

    python -m benchmarks per-layer-compare UNROTATED.json ROTATED.json --labels unrotated rotated \
        --name per_layer_rotation_qwen2.5-coder-0.5b
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks import reports_dir
from quasar_hf.bench.report import markdown_table

SPLITS = ("both", "act", "weight")


def _db(e: dict, split: str) -> float | None:
    return e.get(f"{split}_sqnr_db")


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def compare_markdown(a: dict, b: dict, labels: tuple[str, str], kinds: list[str], command: str) -> str:
    """Markdown: totals per kind, then per layer of `kinds`, each split as label A | label B | change."""
    if a["model"] != b["model"]:
        raise ValueError(f"the reports are of different models: {a['model']!r} and {b['model']!r}")
    la, lb = labels
    head = [f"{split} {label}" for split in SPLITS for label in (la, lb, "change")]
    lines = [f"# Per-layer W8A8 error, {la} vs {lb}: {a['model']}", "", "Command:", "", "```", command, "```", ""]
    for label, r in ((la, a), (lb, b)):
        lines += [f"- **{label}**: `{r['command']}`; {r['quantization']}; held-out {r['heldout']}."]
    lines += [
        "",
        "SQNR in dB (higher is better; change = "
        f"{lb} - {la}). act = per-token int8 activations x float weights, weight = int8 weights x float "
        "activations, both = W8A8. Totals pool error energy over the linears of a kind.",
        "",
        "## Per kind",
        "",
    ]

    def cells(ea: dict, eb: dict) -> list:
        return [v for s in SPLITS for v in (_db(ea, s), _db(eb, s), _delta(_db(ea, s), _db(eb, s)))]

    totals = [["all", *cells(a["report"]["totals"], b["report"]["totals"])]]
    totals += [
        [k, *cells(e, b["report"]["by_kind"][k])] for k, e in a["report"]["by_kind"].items() if k in b["report"]["by_kind"]
    ]
    lines += markdown_table(["kind", *head], totals) + [""]
    rows_b = {r["name"]: r for r in b["report"]["rows"]}
    for kind in kinds:
        rows = sorted((r for r in a["report"]["rows"] if r["kind"] == kind and r["name"] in rows_b), key=lambda r: r["layer"])
        if rows:
            lines += [f"## {kind}, per layer", ""]
            lines += markdown_table(["layer", *head], [[r["layer"], *cells(r, rows_b[r["name"]])] for r in rows]) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[str]:
    """CLI: write NAME.md comparing two per-layer JSON reports."""
    import shlex
    import sys

    parser = argparse.ArgumentParser(prog="python -m benchmarks per-layer-compare", description=__doc__)
    parser.add_argument("first", help="per-layer JSON report (the baseline)")
    parser.add_argument("second", help="per-layer JSON report of the same model (the change)")
    parser.add_argument("--labels", nargs=2, default=("first", "second"), metavar=("A", "B"))
    parser.add_argument("--kinds", nargs="+", default=["down_proj", "o_proj"], help="kinds shown per layer")
    parser.add_argument("--out", default=reports_dir("per-layer-compare"))
    parser.add_argument("--name", required=True)
    args = parser.parse_args(argv)
    reports = []
    for path in (args.first, args.second):
        try:
            with open(path) as f:
                reports.append(json.load(f))
        except (OSError, json.JSONDecodeError) as error:
            parser.error(f"cannot read the per-layer report {path}: {error}")
    command = "python -m benchmarks per-layer-compare " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    try:
        text = compare_markdown(*reports, tuple(args.labels), args.kinds, command)
    except (KeyError, ValueError) as error:
        parser.error(f"not two per-layer reports of one model: {error}")
    path = os.path.join(args.out, f"{args.name}.md")
    with open(path, "w") as f:
        f.write(text)
    return [path]
