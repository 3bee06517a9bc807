"""Two source trees' decode and verify steps side by side, batch by batch (A, B, A, B, ...) on one
saved checkpoint (or B on a second one, `--quantized-b`: two quantization options on one tree),
so a change is measured as a ratio on a shared, noisy machine. Two worker
processes (one per tree) load the checkpoint once, then take turns: each batch times 1- and 6-token
forwards over a 300-token cache (RowAlignedCache, as the speculative loop runs them) with all
threads and with one. With `--compiled` the workers time the compiled steps instead (a static KV cache
and `quasar={"compile": True}`'s compile config, both shapes compiled before the first batch). Writes
JSON (every batch, the environment) and a table of per-row medians and minima.

    python -m benchmarks ab-step --a /path/to/before --b . --quantized DIR [--rounds 8] [--steps 20]
        --out benchmarks/NAME.json
    python -m benchmarks ab-step --a . --b . --quantized UNROTATED --quantized-b ROTATED --out ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from quasar_hf.bench.report import environment

# A worker per tree (its own interpreter path: only APIs both trees have). It loads the checkpoint,
# then on each "go" line times one batch of `steps` forwards per row and prints them as JSON, so the
# driver can alternate A and B batch by batch: the machine's noise falls on both alike.
WORKER = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
import quasar_hf
from quasar_hf.speculative.row_aligned_cache import RowAlignedCache
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
steps, vocab, compiled = int(sys.argv[2]), model.config.vocab_size, sys.argv[3] == "compiled"
cpu = torch.device("cpu")
if compiled:
    try:  # a tree whose compiled steps need a graph pass names its config there
        from quasar_hf.ops.graph_passes import compile_config
    except ImportError:
        from quasar_hf.compat import default_compile_config as compile_config
    from quasar_hf.speculative.static_cache import StaticVerifierCache, static_cache_slots
    from quasar_hf import compat
    try:  # a tree that has it compiles steps through it
        from quasar_hf.speculative.step_compiler import compiled_step as make_step
    except ImportError:
        make_step = getattr(compat, "compiled_step", None)
    step = make_step(model, compile_config(cpu)) if make_step else model.get_compiled_call(compile_config(cpu))
    state = StaticVerifierCache(model, 1, cpu, static_cache_slots(307), step=step)
else:
    state = RowAlignedCache(model, 1, cpu)
threads = torch.get_num_threads()
with torch.no_grad():
    state.forward(torch.randint(0, vocab, (1, 300)))
    for count in sorted({threads, 1}, reverse=True) if compiled else ():  # compile every graph before timing
        torch.set_num_threads(count)
        for tokens in (1, 6):
            state.forward(torch.randint(0, vocab, (1, tokens)))
            state.keep_accepted(torch.tensor([0]), tokens)
    torch.set_num_threads(threads)
    print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        rows = {}
        for count in sorted({threads, 1}, reverse=True):
            torch.set_num_threads(count)
            for tokens in (1, 6):
                for timed in (False, True):
                    start = time.perf_counter()
                    for _ in range(steps if timed else 1):
                        state.forward(torch.randint(0, vocab, (1, tokens)))
                        state.keep_accepted(torch.tensor([0]), tokens)  # back to the same cache length
                rows[f"{count}x{tokens}"] = (time.perf_counter() - start) / steps * 1e3
        torch.set_num_threads(threads)
        print(json.dumps({"rows": rows}), flush=True)
"""


def start_worker(tree: Path, quantized: str, steps: int, compiled: bool = False) -> tuple[subprocess.Popen, dict]:
    """A worker process with `tree` first on the import path, once its model is loaded (and, with
    `compiled`, its steps compiled)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, quantized, str(steps), "compiled" if compiled else "eager"],
        env=env,
        cwd=tree,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return worker, json.loads(worker.stdout.readline())


def batch(worker: subprocess.Popen) -> dict:
    worker.stdin.write("go\n")
    worker.stdin.flush()
    return json.loads(worker.stdout.readline())


def git_commit(tree: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=tree, capture_output=True, text=True).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


def summarize(runs: list[dict]) -> dict:
    """Per row (threads x tokens): median and minimum ms per step over the runs."""
    return {
        key: {"median_ms": statistics.median(r["rows"][key] for r in runs), "min_ms": min(r["rows"][key] for r in runs)}
        for key in runs[0]["rows"]
    }


def to_markdown(report: dict) -> str:
    a, b = report["a"], report["b"]
    b_model = report.get("quantized_b", report["quantized"])
    models = Path(report["quantized"]).name + ("" if b_model == report["quantized"] else f" vs {Path(b_model).name}")
    lines = [
        f"# {'Compiled d' if report.get('compiled') else 'D'}ecode and verify steps, A and B side by side ({models})",
        "",
        f"Command: `{report['command']}`. A = `{a['commit']}` on `{Path(report['quantized']).name}`, B = `{b['commit']}` "
        f"on `{Path(b_model).name}`; {report['rounds']} rounds "
        f"alternating A, B (one worker process per tree); a batch's figure is the mean of {report['steps']} forwards over a "
        f"300-token cache. CPU: {report['environment']['cpu']}, torch {report['environment']['torch']}.",
        "",
        "| threads x tokens | A median ms | B median ms | A min ms | B min ms | B / A (min) | B / A per pair: median [quartiles] |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, ra in a["summary"].items():
        rb, pair = b["summary"][key], paired_ratios(a["runs"], b["runs"], key)
        lines.append(
            f"| {key} | {ra['median_ms']:.2f} | {rb['median_ms']:.2f} | {ra['min_ms']:.2f} | {rb['min_ms']:.2f} | "
            f"{rb['min_ms'] / ra['min_ms']:.3f} | {pair[1]:.3f} [{pair[0]:.3f}, {pair[2]:.3f}] |"
        )
    return "\n".join(lines) + "\n"


def paired_ratios(runs_a: list[dict], runs_b: list[dict], key: str) -> list[float]:
    """Quartiles of B / A over the batch pairs (each B batch ran right after its A batch)."""
    ratios = [b["rows"][key] / a["rows"][key] for a, b in zip(runs_a, runs_b)]
    return statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, type=Path, help="the first source tree (e.g. a worktree of main)")
    parser.add_argument("--b", required=True, type=Path, help="the second source tree")
    parser.add_argument("--quantized", required=True, help="a saved Quasar checkpoint both trees load")
    parser.add_argument("--quantized-b", default=None, help="a second checkpoint for B (default: --quantized)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compiled", action="store_true", help="time the compiled static-cache steps, not eager ones")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    models = {"a": args.quantized, "b": args.quantized_b or args.quantized}
    workers = {name: start_worker(tree, models[name], args.steps, args.compiled) for name, tree in trees.items()}
    for _ in range(args.rounds):
        for name, (worker, _) in workers.items():  # A, B, A, B, ...: one batch each in turn
            runs[name].append(batch(worker))
    for worker, _ in workers.values():
        worker.stdin.close()
        worker.wait()
    report = {
        "command": "python -m benchmarks ab-step " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quantized": args.quantized,
        "quantized_b": models["b"],
        "environment": {**environment(), "torch": workers["a"][1]["torch"]},  # the trees' torch
        "rounds": args.rounds,
        "steps": args.steps,
        "compiled": args.compiled,
        **{
            name: {"tree": str(trees[name]), "commit": git_commit(trees[name]), "runs": r, "summary": summarize(r)}
            for name, r in runs.items()
        },
    }
    args.out.write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text(to_markdown(report))
    print(to_markdown(report))
    return report


if __name__ == "__main__":
    main()
