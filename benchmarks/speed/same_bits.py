"""Two source trees on the same saved checkpoints: are the eager logits and tokens bit-identical?

Each tree runs in a process of its own (its package first on sys.path) and records, per checkpoint:
the logits of an 80-token prompt (its prefill goes to SDPA), of its first 40 tokens (the row-stable
kernels), 24 tokens of plain greedy decoding after those 40, and the same with `quasar=True`; with
`--compiled`, also 24 tokens of compiled plain greedy decoding and of compiled `quasar=True` (each
tree's default compile config). The driver compares the records tensor by tensor. A refactor of the
kernels' call paths must leave all identical; `quasar=True` must equal plain greedy in each tree,
eager and compiled.

    python -m benchmarks same-bits --a /path/to/before --b . --quantized DIR [DIR ...] [--compiled] --out benchmarks/reports/same-bits/NAME.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.speed.ab_step import git_commit
from quasar_hf.bench.report import environment

# Runs under one tree: loads the checkpoint with that tree's quasar_hf and saves what it computed.
WORKER = r"""
import sys
tree, checkpoint, out, compiled = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "compiled"
sys.path.insert(0, tree)
import torch
from transformers import AutoModelForCausalLM
import quasar_hf
assert quasar_hf.__file__.startswith(tree), quasar_hf.__file__
model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
ids = torch.randint(0, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
prompt, mask = ids[:, :40], torch.ones(1, 40, dtype=torch.long)
with torch.no_grad():
    record = {
        "logits_80_token_prefill": model(ids).logits,
        "logits_40_token_prefill": model(prompt).logits,
        "greedy_24_tokens": model.generate(prompt, attention_mask=mask, max_new_tokens=24, do_sample=False, quasar=False),
        "quasar_24_tokens": model.generate(prompt, attention_mask=mask, max_new_tokens=24, do_sample=False, quasar=True),
    }
    if compiled:
        steps = {"compile": True, "num_draft_tokens": 0}
        record["compiled_greedy_24_tokens"] = model.generate(prompt, attention_mask=mask, max_new_tokens=24, do_sample=False, quasar=steps)
        record["compiled_quasar_24_tokens"] = model.generate(prompt, attention_mask=mask, max_new_tokens=24, do_sample=False, quasar={"compile": True})
torch.save(record, out)
"""


def run_tree(tree: Path, checkpoint: str, out: Path, compiled: bool = False) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = [sys.executable, "-c", WORKER, str(tree), checkpoint, str(out), "compiled" if compiled else "eager"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the worker under {tree} failed on {checkpoint}:\n{done.stderr[-3000:]}")


def compare(path_a: Path, path_b: Path) -> dict:
    import torch

    a, b = torch.load(path_a), torch.load(path_b)
    rows = {}
    for key in a:
        same = torch.equal(a[key], b[key])
        diff = 0.0 if same else float((a[key].float() - b[key].float()).abs().max())
        rows[key] = {"identical": same, "max_abs_difference": diff}
    rows["quasar_equals_greedy"] = {"a": torch.equal(a["greedy_24_tokens"], a["quasar_24_tokens"]),
                                    "b": torch.equal(b["greedy_24_tokens"], b["quasar_24_tokens"])}  # fmt: skip
    if "compiled_quasar_24_tokens" in a:
        rows["compiled_quasar_equals_compiled_greedy"] = {
            tag: torch.equal(r["compiled_greedy_24_tokens"], r["compiled_quasar_24_tokens"]) for tag, r in (("a", a), ("b", b))
        }
    return rows


def to_markdown(report: dict) -> str:
    lines = [
        "# The same bits from two source trees" + (", eager and compiled" if report.get("compiled") else " (eager)"),
        "",
        f"Command: `{report['command']}`. A = `{report['a']}`, B = `{report['b']}`; each tree in its own process. "
        f"CPU: {report['environment']['cpu']}, torch {report['environment']['torch']}.",
        "",
    ]
    checks = ("quasar_equals_greedy", "compiled_quasar_equals_compiled_greedy")
    for index, (name, rows) in enumerate(report["checkpoints"].items()):
        compared = [k for k in rows if k not in checks]
        held = [k for k in checks if k in rows]
        if index == 0:
            header = [k.replace("_", " ") for k in compared] + [f"{k.replace('_', ' ')} (A, B)" for k in held]
            lines += ["| checkpoint | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
        cells = ["identical" if rows[k]["identical"] else f"differ ({rows[k]['max_abs_difference']:.3g})" for k in compared] + [
            f"{rows[k]['a']}, {rows[k]['b']}" for k in held
        ]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, type=Path, help="the first source tree (e.g. a worktree of an older commit)")
    parser.add_argument("--b", required=True, type=Path, help="the second source tree")
    parser.add_argument("--quantized", required=True, nargs="+", help="saved Quasar checkpoints both trees load")
    parser.add_argument("--compiled", action="store_true", help="also compiled greedy and compiled quasar=True tokens")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)

    report = {
        "command": "python -m benchmarks same-bits " + " ".join(argv if argv is not None else sys.argv[1:]),
        "a": git_commit(args.a),
        "b": git_commit(args.b),
        "environment": environment(),
        "compiled": args.compiled,
        "checkpoints": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for checkpoint in args.quantized:
            outs = [Path(scratch) / f"{tag}.pt" for tag in ("a", "b")]
            for tree, out in zip((args.a, args.b), outs):
                run_tree(tree.resolve(), checkpoint, out, args.compiled)
            report["checkpoints"][Path(checkpoint).name] = compare(*outs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(to_markdown(report))
    print(to_markdown(report))
    return report
