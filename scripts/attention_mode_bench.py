"""Interleaved: BF16-verify vs W8A8-verify (quasar), shape-stable vs batched attention, + HF prompt lookup."""
import json, time, statistics, torch, os
import quasar_hf
from quasar_hf import QuasarGenerationConfig, speculative_generate
from quasar_hf.bench.suites import load_suite, render_prompt
from quasar_hf.models import smollm2_135m_instruct
from transformers import AutoModelForCausalLM, AutoTokenizer
bf16 = AutoModelForCausalLM.from_pretrained(smollm2_135m_instruct(), dtype=torch.bfloat16)
w8 = AutoModelForCausalLM.from_pretrained("/tmp/smol_q")
tok = AutoTokenizer.from_pretrained("/tmp/smol_q")
items = load_suite("grounded")[:6]
prompts = [torch.tensor([render_prompt(it, tok)]) for it in items]
N = 128
def spec(model, stable):
    cfg = QuasarGenerationConfig(shape_stable_attention=stable)
    def run(ids):
        out = speculative_generate(model, ids, torch.ones_like(ids), quasar_config=cfg, max_new_tokens=N, do_sample=False, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
        return out.sequences, out.quasar_stats.mean_acceptance_length
    return run
def hf_lookup(ids):
    return bf16.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False, prompt_lookup_num_tokens=5, max_matching_ngram_size=3, pad_token_id=tok.eos_token_id), None
variants = {"hf_prompt_lookup_bf16": hf_lookup, "bf16_verify_stable": spec(bf16, True), "bf16_verify_batched": spec(bf16, False),
            "quasar_stable": spec(w8, True), "quasar_batched": spec(w8, False)}
res = {k: {"tps": [], "L": []} for k in variants}
spec(w8, True)(prompts[0][:, :50]); hf_lookup(prompts[0][:, :50])  # warm-up
names = list(variants)
for i, ids in enumerate(prompts):
    order = names[i % len(names):] + names[:i % len(names)]
    for name in order:
        t = time.perf_counter(); seq, L = variants[name](ids); dt = time.perf_counter() - t
        res[name]["tps"].append((seq.shape[1] - ids.shape[1]) / dt)
        if L: res[name]["L"].append(L)
summary = {k: {"median_tokens_per_s": statistics.median(v["tps"]), "mean_L": (statistics.mean(v["L"]) if v["L"] else None)} for k, v in res.items()}
base = summary["bf16_verify_stable"]["median_tokens_per_s"]
for k, v in summary.items():
    v["x_vs_bf16_verify_stable"] = v["median_tokens_per_s"] / base
    v["x_vs_hf_prompt_lookup"] = v["median_tokens_per_s"] / summary["hf_prompt_lookup_bf16"]["median_tokens_per_s"]
out = {"command": "python scripts/attention_mode_bench.py", "prompts": len(prompts), "max_new_tokens": N,
       "load_average": os.getloadavg(), "summary": summary, "raw": res}
json.dump(out, open("benchmarks/attention_mode_cpu.json", "w"), indent=2)
for k, v in summary.items(): print(k, {a: (round(b, 3) if b else b) for a, b in v.items()})
