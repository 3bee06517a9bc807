"""How verification attention costs speed: the row-stable kernel vs SDPA row by row vs batched SDPA.

Interleaved on the same grounded prompts (greedy, n-gram drafts of 5, 128 new tokens):
  hf_prompt_lookup_bf16   Transformers' prompt lookup on the BF16 model (stock SDPA)
  bf16_verify_rowstable   our loop, BF16 verifier, row-stable kernel (what the benchmark runner uses)
  quasar_rowstable        generate(quasar=True) on the W8A8 model: the default (exact)
  quasar_sdpa_rowwise     the W8A8 model switched to SDPA: one SDPA call per verified row (exact)
  quasar_sdpa_batched     SDPA, one batched call (shape_stable_attention=False: not exact)

    python scripts/attention_mode_bench.py [--quantized DIR] [--prompts 6] [--out benchmarks/attention_mode_cpu.json]
"""

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
from quasar_hf.models import smollm2_135m_instruct
from quasar_hf.ops.rowstable_attention import QUASAR_ATTENTION, use_rowstable_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantized", default=None, help="a saved Quasar checkpoint (default: quantize now)")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="benchmarks/attention_mode_cpu.json")
    args = parser.parse_args()
    source = smollm2_135m_instruct()
    tok = AutoTokenizer.from_pretrained(source)
    bf16 = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval()
    w8 = (
        AutoModelForCausalLM.from_pretrained(args.quantized)
        if args.quantized
        else AutoModelForCausalLM.from_pretrained(source, quantization_config=QuasarConfig(), dtype=torch.bfloat16)
    ).eval()
    prompts = [torch.tensor([render_prompt(it, tok)]) for it in load_suite("grounded")[: args.prompts]]
    n = args.max_new_tokens

    def spec(model, attention, stable=True):
        def run(ids):
            model.set_attn_implementation("sdpa")
            if attention == QUASAR_ATTENTION:
                use_rowstable_attention(model)
            cfg = QuasarGenerationConfig(shape_stable_attention=stable)
            out = speculative_generate(
                model,
                ids,
                torch.ones_like(ids),
                quasar_config=cfg,
                max_new_tokens=n,
                do_sample=False,
                return_dict_in_generate=True,
                pad_token_id=tok.eos_token_id,
            )
            return out.sequences, out.quasar_stats

        return run

    def hf_lookup(ids):
        bf16.set_attn_implementation("sdpa")
        return bf16.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            prompt_lookup_num_tokens=5,
            max_matching_ngram_size=3,
            pad_token_id=tok.eos_token_id,
        ), None

    variants = {
        "hf_prompt_lookup_bf16": hf_lookup,
        "bf16_verify_rowstable": spec(bf16, QUASAR_ATTENTION),
        "quasar_rowstable": spec(w8, QUASAR_ATTENTION),
        "quasar_sdpa_rowwise": spec(w8, "sdpa"),
        "quasar_sdpa_batched": spec(w8, "sdpa", stable=False),
    }
    for run in variants.values():  # warm-up (kernel builds, allocator)
        run(prompts[0][:, :50])
    raw = {k: {"seconds": [], "tokens": [], "emitted": [], "steps": []} for k in variants}
    names = list(variants)
    for i, ids in enumerate(prompts):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            seq, stats = variants[name](ids)
            raw[name]["seconds"].append(time.perf_counter() - start)
            raw[name]["tokens"].append(seq.shape[1] - ids.shape[1])
            if stats is not None:
                raw[name]["emitted"].append(stats.new_tokens)
                raw[name]["steps"].append(stats.verify_steps)
    summary = {}
    for name, r in raw.items():
        summary[name] = {
            "tokens_per_s": sum(r["tokens"]) / sum(r["seconds"]),
            "median_prompt_tokens_per_s": statistics.median(t / s for t, s in zip(r["tokens"], r["seconds"])),
            "L": sum(r["emitted"]) / sum(r["steps"]) if r["steps"] else None,
        }
    for name, s in summary.items():
        s["x_vs_hf_prompt_lookup"] = s["tokens_per_s"] / summary["hf_prompt_lookup_bf16"]["tokens_per_s"]
        s["x_vs_bf16_verify_rowstable"] = s["tokens_per_s"] / summary["bf16_verify_rowstable"]["tokens_per_s"]
        print(name, {k: (round(v, 3) if v else v) for k, v in s.items()})
    out = {
        "command": "python scripts/attention_mode_bench.py " + " ".join(os.sys.argv[1:]),
        "prompts": len(prompts),
        "max_new_tokens": n,
        "load_average_end": os.getloadavg(),
        "torch_threads": torch.get_num_threads(),
        "summary": summary,
        "raw": raw,
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
