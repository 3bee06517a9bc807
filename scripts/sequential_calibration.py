"""Whole-model vs layer-by-layer calibration on SmolLM2-135M: peak RSS, quantize time, held-out perplexity.

    python scripts/sequential_calibration.py --before-ref e57a22f --out benchmarks/sequential_calibration_cpu.json

Each variant runs in its own process (peak RSS = that process's ru_maxrss): it loads the BF16
model, quantizes it with QuasarConfig() defaults (alpha="auto") through `quantize_model`, and then
measures perplexity on 16 x 512 tokens of the built-in "heldout" text (the same blocks as
scripts/alpha_sweep.py). Variants:
  before     the code at --before-ref (whole float model calibrated with hooks, then smoothed);
  quantized  layer by layer, layer i+1 calibrated on the W8A8 layer i's outputs;
  float      layer by layer, layer i+1 calibrated on the float layer i's outputs.
Writes the JSON and a markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("before", "quantized", "float")


def rss_mib() -> float:
    """Current resident set size of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_variant(variant: str, eval_blocks: int) -> dict:
    """In this process: load BF16, quantize, measure; returns the numbers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quasar_hf
    from quasar_hf import QuasarConfig
    from quasar_hf.hf.integration import quantize_model
    from quasar_hf.models import smollm2_135m_instruct
    from quasar_hf.smoothquant.data import build_calibration_blocks, builtin_texts

    sys.path.insert(0, str(ROOT / "scripts"))
    from alpha_sweep import perplexity

    path = smollm2_135m_instruct()
    tokenizer = AutoTokenizer.from_pretrained(path)
    blocks = build_calibration_blocks(builtin_texts("heldout"), tokenizer, eval_blocks, 512, seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    loaded = {"rss_after_load_mib": rss_mib(), "peak_rss_after_load_mib": peak_rss_mib()}
    started = time.perf_counter()
    kwargs = {} if variant == "before" else {"layer_inputs": variant}
    quantize_model(model, QuasarConfig(), progress=False, **kwargs)
    seconds = time.perf_counter() - started
    result = {
        **loaded,
        "rss_after_quantize_mib": rss_mib(),
        "peak_rss_mib": peak_rss_mib(),
        "quantize_seconds": round(seconds, 1),
        "quasar_hf_file": quasar_hf.__file__,
        "torch_threads": torch.get_num_threads(),
    }
    result["perplexity"] = perplexity(model, blocks)
    if variant == "quantized":  # the BF16 reference, once, in the same way
        del model
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        result["bf16_perplexity"] = perplexity(reference, blocks)
    return result


def source_tree(ref: str, into: Path) -> Path:
    """The quasar_hf package as committed at `ref`, extracted under `into` (the repo is not touched)."""
    archive = into / "src.tar"
    with open(archive, "wb") as fh:
        subprocess.run(["git", "-C", str(ROOT), "archive", ref, "quasar_hf"], stdout=fh, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def spawn(variant: str, pythonpath: Path, eval_blocks: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    cmd = [sys.executable, __file__, "--variant", variant, "--eval-blocks", str(eval_blocks)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=tempfile.gettempdir())
    return json.loads(out.stdout.strip().splitlines()[-1])


def environment() -> dict:
    import torch
    import transformers

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit,
        "load_average_at_start": os.getloadavg(),
    }


def markdown(report: dict) -> str:
    rows = report["results"]
    bf16 = rows["quantized"]["bf16_perplexity"]
    lines = [
        "# Layer-by-layer vs whole-model calibration (SmolLM2-135M-Instruct, CPU)",
        "",
        f"Command: `{report['command']}`",
        "",
        'QuasarConfig() defaults (alpha="auto", 32 x 512 calibration tokens); perplexity on '
        f"{report['eval']}; BF16 perplexity {bf16:.3f}. RSS in MiB; each variant in its own process.",
        "",
        "| variant | perplexity | vs BF16 | RSS after BF16 load | peak RSS (load + quantize) | quantize s |",
        "|---|---|---|---|---|---|",
    ]
    names = {
        "before": f"whole model (`{report['before_ref']}`)",
        "quantized": "layer by layer, quantized inputs",
        "float": "layer by layer, float inputs",
    }
    for key in [v for v in VARIANTS if v in rows]:
        r = rows[key]
        lines.append(
            f"| {names[key]} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / bf16 - 1):+.2f} % | "
            f"{r['rss_after_load_mib']:.0f} | {r['peak_rss_mib']:.0f} | {r['quantize_seconds']} |"
        )
    env = report["environment"]
    lines += [
        "",
        "Environment: "
        + ", ".join(f"{k} {v}" for k, v in env.items())
        + f"; load average at end {report['load_average_at_end']}.",
        "Times were taken on a shared, loaded machine: compare them with care.",
        "",
    ]
    return "\n".join(lines)


def merge(paths: list[str], out: Path) -> None:
    """One report from several runs: results side by side, each run's command and environment kept."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    merged = {**reports[0], "results": {}, "runs": []}
    for report in reports:
        merged["results"].update(report["results"])
        merged["runs"].append({k: report[k] for k in ("command", "environment", "load_average_at_end")})
    merged["command"] = " ; ".join(r["command"] for r in merged["runs"])
    out.write_text(json.dumps(merged, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(merged))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before-ref", default="e57a22f", help="git ref of the whole-model calibration code")
    parser.add_argument("--eval-blocks", type=int, default=16)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default="benchmarks/sequential_calibration_cpu.json")
    parser.add_argument("--merge", nargs="+", help="combine the JSON reports of separate runs (one variant each) into --out")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.eval_blocks)))
        return
    if args.merge:
        merge(args.merge, Path(args.out))
        return
    report = {
        "command": f"python scripts/sequential_calibration.py --before-ref {args.before_ref} --variants {args.variants} --out {args.out}",
        "before_ref": args.before_ref,
        "eval": f"{args.eval_blocks} x 512 tokens of the built-in heldout text",
        "environment": environment(),
        "results": {},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        before = source_tree(args.before_ref, Path(tmp))
        for variant in args.variants.split(","):
            report["results"][variant] = spawn(variant, before if variant == "before" else ROOT, args.eval_blocks)
            print(variant, report["results"][variant], flush=True)
    report["load_average_at_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if "quantized" in report["results"]:  # the BF16 reference is measured with that variant
        Path(args.out).with_suffix(".md").write_text(markdown(report))


if __name__ == "__main__":
    main()
