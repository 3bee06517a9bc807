"""Generation benchmark on this machine: plain greedy vs prompt lookup vs our loop (BF16 / W8A8 verify).

All variants run interleaved (variant order rotates per prompt) on the same input-grounded
prompts, so machine load hits them alike. Per variant: median tokens/s over prompts, mean
acceptance length L = (new tokens - 1) / (verifier forwards - 1) counted with a forward hook
(the prefill produces the first token; for our loop this equals QuasarStats' L), and whether
the greedy outputs agree with the variant's own plain greedy reference.

    python -m quasar_hf.bench.generation --out benchmarks/generation_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

VARIANTS = ("bf16_greedy", "hf_prompt_lookup", "bf16_verify", "quasar")
PROMPT_LOOKUP = {"prompt_lookup_num_tokens": 5, "max_matching_ngram_size": 3}


def load_models(model_path: str | None, quasar_path: str | None, quantization_config: Any = None):
    """(BF16 model, Quasar W8A8 model, tokenizer); quantizes on the fly when no Quasar checkpoint is given."""
    import quasar_hf  # noqa: F401  (registers quant_method "quasar")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quasar_hf.hf.generate_hook import install_generate_hook

    install_generate_hook()
    if model_path is None:
        from quasar_hf.models import smollm2_135m_instruct

        model_path = smollm2_135m_instruct()
    bf16 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
    if quasar_path is not None:
        quasar = AutoModelForCausalLM.from_pretrained(quasar_path).eval()
    else:
        from quasar_hf import QuasarConfig

        config = quantization_config if quantization_config is not None else QuasarConfig()
        quasar = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=config, dtype=torch.bfloat16).eval()
    return bf16, quasar, AutoTokenizer.from_pretrained(model_path)


def grounded_prompts(tokenizer, limit: int) -> list[tuple[str, torch.Tensor]]:
    """(id, input_ids [1, T]) of the packaged input-grounded suite (rewrite / edit / summarize / extract)."""
    from quasar_hf.bench.suites import load_suite, render_prompt

    items = load_suite("grounded")[:limit]
    return [(item["id"], torch.tensor([render_prompt(item, tokenizer)])) for item in items]


class ForwardCounter:
    """Counts forward calls of a model (verifier forwards, for L)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def make_variants(bf16, quasar_model, num_draft_tokens: int, max_ngram_size: int) -> dict[str, tuple[torch.nn.Module, Callable]]:
    """name -> (the verifier model whose forwards are counted, generate(input_ids, max_new_tokens))."""
    from quasar_hf.speculative import QuasarGenerationConfig, speculative_generate

    loop_config = QuasarGenerationConfig(drafter="ngram", num_draft_tokens=num_draft_tokens, max_ngram_size=max_ngram_size)
    greedy = {"do_sample": False}
    return {
        "bf16_greedy": (bf16, lambda ids, n: bf16.generate(ids, max_new_tokens=n, **greedy)),
        "hf_prompt_lookup": (bf16, lambda ids, n: bf16.generate(ids, max_new_tokens=n, **greedy, **PROMPT_LOOKUP)),
        "bf16_verify": (bf16, lambda ids, n: speculative_generate(bf16, ids, max_new_tokens=n, quasar_config=loop_config, **greedy)),
        "quasar": (quasar_model, lambda ids, n: quasar_model.generate(ids, max_new_tokens=n, quasar=loop_config, **greedy)),
    }


def time_one(model: torch.nn.Module, generate: Callable, input_ids: torch.Tensor, max_new_tokens: int) -> dict:
    counter = ForwardCounter(model)
    try:
        started = time.perf_counter()
        with torch.no_grad():
            out = generate(input_ids, max_new_tokens)
        seconds = time.perf_counter() - started
    finally:
        counter.close()
    new_tokens = out.shape[1] - input_ids.shape[1]
    return {
        "seconds": seconds,
        "new_tokens": new_tokens,
        "tokens_per_s": new_tokens / seconds,
        "forwards": counter.calls,
        "acceptance_length": (new_tokens - 1) / max(counter.calls - 1, 1),
        "tokens": out[0, input_ids.shape[1] :].tolist(),
    }


def run_generation_benchmark(
    model_path: str | None = None,
    quasar_path: str | None = None,
    num_prompts: int = 8,
    max_new_tokens: int = 128,
    repeats: int = 1,
    variants: tuple[str, ...] = VARIANTS,
    num_draft_tokens: int = 5,
    max_ngram_size: int = 3,
    num_threads: int | None = None,
    quantization_config: Any = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Run the interleaved generation benchmark; return a JSON-ready dict (config, per-run rows, summary, targets)."""
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"Unknown variant(s) {unknown}; choose from {list(VARIANTS)}.")
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    bf16, quasar_model, tokenizer = load_models(model_path, quasar_path, quantization_config)
    table = make_variants(bf16, quasar_model, num_draft_tokens, max_ngram_size)
    prompts = grounded_prompts(tokenizer, num_prompts)
    for name in variants:  # warm-up (kernel builds, allocator) outside the timings
        model, generate = table[name]
        time_one(model, generate, prompts[0][1][:, :32], 8)
    runs = []
    for repeat in range(repeats):
        for index, (prompt_id, input_ids) in enumerate(prompts):
            order = list(variants[index % len(variants) :]) + list(variants[: index % len(variants)])
            for name in order:
                model, generate = table[name]
                row = {"variant": name, "prompt": prompt_id, "repeat": repeat, "prompt_tokens": input_ids.shape[1]}
                row.update(time_one(model, generate, input_ids, max_new_tokens))
                runs.append(row)
                log(f"{prompt_id} {name:17s} {row['tokens_per_s']:7.2f} tok/s  L={row['acceptance_length']:.2f}")
    summary = summarize(runs, variants)
    return {
        "benchmark": "generation",
        "config": {
            "model": model_path or "SmolLM2-135M-Instruct (quasar_hf.models)",
            "quasar_model": quasar_path or "quantized on the fly",
            "quasar_config": _quasar_config_dict(quasar_model),
            "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "repeats": repeats,
            "num_draft_tokens": num_draft_tokens, "max_ngram_size": max_ngram_size, "prompt_lookup": PROMPT_LOOKUP,
            "greedy": True, "suite": "grounded",
        },
        "environment": environment(),
        "summary": summary,
        "ratios": ratios(summary),
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
        "agreement": agreement(runs),
    }


def summarize(runs: list[dict], variants: tuple[str, ...]) -> dict:
    """Per variant: median tokens/s over runs, aggregate tokens/s, mean L."""
    out = {}
    for name in variants:
        rows = [r for r in runs if r["variant"] == name]
        out[name] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows),
            "tokens_per_s_aggregate": sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows),
            "acceptance_length": (sum(r["new_tokens"] - 1 for r in rows) / max(sum(r["forwards"] - 1 for r in rows), 1)),
            "new_tokens": sum(r["new_tokens"] for r in rows),
            "seconds": sum(r["seconds"] for r in rows),
        }
    return out


def ratios(summary: dict) -> dict:
    """The issue's targets: quasar vs BF16-verify loop and vs Transformers' prompt lookup; L within 3 %."""
    def ratio(a: str, b: str, key: str = "tokens_per_s_median") -> float | None:
        return summary[a][key] / summary[b][key] if a in summary and b in summary else None

    result = {
        "quasar_over_bf16_verify": ratio("quasar", "bf16_verify"),
        "quasar_over_hf_prompt_lookup": ratio("quasar", "hf_prompt_lookup"),
        "quasar_over_bf16_greedy": ratio("quasar", "bf16_greedy"),
        "bf16_verify_over_hf_prompt_lookup": ratio("bf16_verify", "hf_prompt_lookup"),
        "L_quasar_over_L_bf16_verify": ratio("quasar", "bf16_verify", "acceptance_length"),
    }
    result["targets"] = {
        "quasar_over_bf16_verify>=1.25": _at_least(result["quasar_over_bf16_verify"], 1.25),
        "quasar_over_hf_prompt_lookup>=1.2": _at_least(result["quasar_over_hf_prompt_lookup"], 1.2),
        "L_within_3pct": None if result["L_quasar_over_L_bf16_verify"] is None else abs(result["L_quasar_over_L_bf16_verify"] - 1) <= 0.03,
    }
    return result


def _at_least(value: float | None, bound: float) -> bool | None:
    return None if value is None else value >= bound


def agreement(runs: list[dict]) -> dict:
    """Greedy token agreement: BF16 loop vs BF16 greedy (should be 1.0 up to near-ties), quasar vs BF16 greedy."""
    def fraction(a: str, b: str) -> float | None:
        pairs = [(x, y) for x in runs if x["variant"] == a for y in runs
                 if y["variant"] == b and y["prompt"] == x["prompt"] and y["repeat"] == x["repeat"]]
        if not pairs:
            return None
        same = sum(sum(p == q for p, q in zip(x["tokens"], y["tokens"])) for x, y in pairs)
        return same / sum(max(len(x["tokens"]), len(y["tokens"])) for x, y in pairs)

    return {
        "bf16_verify_vs_bf16_greedy": fraction("bf16_verify", "bf16_greedy"),
        "hf_prompt_lookup_vs_bf16_greedy": fraction("hf_prompt_lookup", "bf16_greedy"),
        "quasar_vs_bf16_greedy": fraction("quasar", "bf16_greedy"),
    }


def _quasar_config_dict(model: torch.nn.Module) -> dict:
    qconfig = getattr(model.config, "quantization_config", None)
    data = qconfig if isinstance(qconfig, dict) else (qconfig.to_dict() if qconfig is not None else {})
    keep = ("alpha", "backend", "num_calibration_samples", "calibration_seq_len", "calibration_info", "version")
    return {k: data.get(k) for k in keep if k in data}


def environment() -> dict:
    import transformers

    from quasar_hf.ops.dispatch import available_backends

    return {
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "processor": platform.processor(), "torch_threads": torch.get_num_threads(),
        "w8a8_backends": list(available_backends()), "load_average": _load_average(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _load_average() -> list[float] | None:
    try:
        import os

        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def write_markdown(result: dict, path: Path) -> None:
    """A short human-readable table next to the JSON."""
    lines = ["# Generation benchmark (CPU)", "", f"Command: `{result.get('command', '')}`", "",
             f"Environment: {json.dumps(result['environment'])}", "",
             "| variant | median tok/s | aggregate tok/s | L |", "|---|---|---|---|"]
    for name, s in result["summary"].items():
        lines.append(f"| {name} | {s['tokens_per_s_median']:.2f} | {s['tokens_per_s_aggregate']:.2f} | {s['acceptance_length']:.3f} |")
    lines += ["", "Ratios and targets:", "", "```", json.dumps(result["ratios"], indent=2), "```", "",
              "Greedy token agreement:", "", "```", json.dumps(result["agreement"], indent=2), "```", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="BF16 checkpoint (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--quasar-model", default=None, help="Quasar W8A8 checkpoint (default: quantize --model now)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/generation_cpu.json")
    args = parser.parse_args(argv)
    result = run_generation_benchmark(
        args.model, args.quasar_model, args.num_prompts, args.max_new_tokens, args.repeats,
        tuple(v for v in args.variants.split(",") if v), num_threads=args.threads,
    )
    result["command"] = " ".join(["python -m quasar_hf.bench.generation", *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    write_markdown(result, out.with_suffix(".md"))
    print(json.dumps({"summary": result["summary"], "ratios": result["ratios"]}, indent=2))
    return result


if __name__ == "__main__":
    main()
