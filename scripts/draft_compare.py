"""Issue 4's comparison on SmolLM2-135M (CPU): ngram vs self (BF16 and INT8 draft layers) vs assistant drafting.

    python scripts/draft_compare.py --draft-layers 0,1,2,... --out benchmarks/draft_compare_cpu.json

W8A8 verification in every variant; interleaved; greedy; 128 new tokens on "grounded" prompts.
The assistant is the unquantized BF16 model itself: the only causal LM sharing this tokenizer
that installs offline (an upper bound on acceptance at the highest draft cost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quasar_hf  # noqa: F401
from quasar_hf import QuasarConfig, QuasarGenerationConfig, speculative_generate
from quasar_hf.bench.suites import load_suite, render_prompt
from quasar_hf.hf.draft_path import module_bytes
from quasar_hf.models import smollm2_135m_instruct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draft-layers", required=True, help="comma-separated layer indices (e.g. the auto choice)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/draft_compare_cpu.json")
    args = parser.parse_args()
    layers = [int(i) for i in args.draft_layers.split(",")]
    path = smollm2_135m_instruct()
    tok = AutoTokenizer.from_pretrained(path)
    bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    models = {
        dtype: AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, quantization_config=QuasarConfig(draft_layers=layers, draft_dtype=dtype)
        )
        for dtype in ("model", "int8")
    }
    variants = {
        "ngram": (models["int8"], QuasarGenerationConfig(drafter="ngram")),
        "self_bf16_layers": (models["model"], QuasarGenerationConfig(drafter="self")),
        "self_int8_layers": (models["int8"], QuasarGenerationConfig(drafter="self")),
        "assistant_bf16_full_model": (models["int8"], QuasarGenerationConfig(drafter="assistant", assistant_model=bf16)),
    }
    prompts = [torch.tensor([render_prompt(it, tok)]) for it in load_suite("grounded")[: args.prompts]]
    raw = {name: [] for name in variants}
    for i, ids in enumerate(prompts):
        names = list(variants)[i % len(variants) :] + list(variants)[: i % len(variants)]
        for name in names:
            model, cfg = variants[name]
            started = time.perf_counter()
            out = speculative_generate(
                model,
                ids,
                torch.ones_like(ids),
                quasar_config=cfg,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                return_dict_in_generate=True,
                pad_token_id=tok.eos_token_id,
            )
            seconds = time.perf_counter() - started
            s = out.quasar_stats
            raw[name].append(
                {
                    "tokens_per_s": (out.sequences.shape[1] - ids.shape[1]) / seconds,
                    "L": s.mean_acceptance_length,
                    "draft_ms_per_token": 1e3 * s.draft_time_s / max(1, s.drafted_tokens),
                }
            )
    summary = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in raw.items()}
    memory = {dtype: module_bytes(m) for dtype, m in models.items()}
    report = {
        "command": f"python scripts/draft_compare.py --draft-layers {args.draft_layers} --prompts {args.prompts} "
        f"--max-new-tokens {args.max_new_tokens}",
        "draft_info": {d: m.config.quantization_config.draft_info for d, m in models.items()},
        "model_bytes": memory,
        "summary": summary,
        "raw": raw,
        "load_average": os.getloadavg(),
    }
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    for name, row in summary.items():
        print(name, {k: round(v, 3) for k, v in row.items()})
    print("model bytes", memory)


if __name__ == "__main__":
    main()
