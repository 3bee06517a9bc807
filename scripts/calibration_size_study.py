"""How W8A8 perplexity moves with the number of calibration samples (SmolLM2-135M by default).

    python scripts/calibration_size_study.py --sizes 16,32,64,128 --name calibration_size_smollm2

For each size, the model is quantized with `QuasarConfig(num_calibration_samples=N)` (other
fields default) on the built-in "calibration" half of the Python docs text, and its perplexity
is measured on blocks of the disjoint "heldout" half, as is the float model's. Perplexity does
not depend on machine load; quantization time does (it is recorded, not compared).
The built-in calibration text holds 115 blocks of 512 SmolLM2 tokens: a larger N uses them all
(the JSON records the number actually used).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quasar_hf import QuasarConfig
from quasar_hf.bench.report import environment
from quasar_hf.smoothquant.data import build_calibration_blocks, builtin_texts


@torch.no_grad()
def perplexity(model: torch.nn.Module, blocks: torch.Tensor) -> float:
    """exp(mean next-token NLL) over [N, T] blocks, logits in fp32."""
    total, count = 0.0, 0
    for block in blocks:
        logits = model(input_ids=block[None], use_cache=False).logits.float()[0, :-1]
        total += torch.nn.functional.cross_entropy(logits, block[1:], reduction="sum").item()
        count += block.numel() - 1
    return math.exp(total / count)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"# W8A8 perplexity vs calibration size: {report['model']}",
        "",
        "Command:",
        "",
        "```",
        report["command"],
        "```",
        "",
        f"Environment: {env['cpu']} ({env['cpu_count']} CPUs), torch {env['versions']['torch']}, transformers "
        f"{env['versions']['transformers']}, load average {env['load_average']}, commit {env['git_commit']}.",
        f"Held-out: {report['eval']}. Float perplexity {report['float_perplexity']:.4f}.",
        "",
        "| samples asked | samples used | tokens | W8A8 perplexity | ratio vs float | quantize s (loaded machine) |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        lines.append(
            f"| {row['asked']} | {row['used']} | {row['tokens']} | {row['perplexity']:.4f} | {row['ratio']:.4f} | "
            f"{row['quantize_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="float checkpoint folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--sizes", default="16,32,64,128")
    parser.add_argument("--eval-blocks", type=int, default=16)
    parser.add_argument("--eval-seq-len", type=int, default=512)
    parser.add_argument("--out", default="benchmarks")
    parser.add_argument("--name", default="calibration_size_smollm2")
    args = parser.parse_args(argv)
    command = "python scripts/calibration_size_study.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)
    )

    path = args.model
    if path is None:
        from quasar_hf.models import smollm2_135m_instruct

        path = smollm2_135m_instruct()
    tokenizer = AutoTokenizer.from_pretrained(path)
    blocks = build_calibration_blocks(builtin_texts("heldout"), tokenizer, args.eval_blocks, args.eval_seq_len, seed=1)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    report = {
        "command": command,
        "model": os.path.basename(os.path.normpath(path)),
        "eval": f"{blocks.shape[0]} blocks x {blocks.shape[1]} tokens of the builtin heldout split (seed 1)",
        "float_perplexity": perplexity(base, blocks),
        "results": [],
    }
    del base
    json_path, md_path = (os.path.join(args.out, f"{args.name}.{ext}") for ext in ("json", "md"))
    os.makedirs(args.out, exist_ok=True)
    for size in (int(s) for s in args.sizes.split(",")):
        started = time.perf_counter()
        config = QuasarConfig(num_calibration_samples=size)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=config).eval()
        seconds = time.perf_counter() - started
        info = model.config.quantization_config.calibration_info
        ppl = perplexity(model, blocks)
        report["results"].append(
            {
                "asked": size,
                "used": info["num_samples"],
                "tokens": info["tokens"],
                "perplexity": ppl,
                "ratio": ppl / report["float_perplexity"],
                "quantize_s": seconds,
            }
        )
        del model
        report["environment"] = environment()
        with open(json_path, "w") as fh:  # after every size: partial results survive an interrupted run
            json.dump(report, fh, indent=1)
        with open(md_path, "w") as fh:
            fh.write(markdown(report))
        print(report["results"][-1], flush=True)
    return [json_path, md_path]


if __name__ == "__main__":
    for written in main():
        print(written)
