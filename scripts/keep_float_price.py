"""What `QuasarConfig(keep_float=...)` costs at decode time: bytes per step, step time, tokens/s.

Loads saved Quasar checkpoints of one model (e.g. the default and a keep_float="auto" one) and,
interleaved round by round so machine noise hits every checkpoint alike, times:
  * one forward of 1 and of 6 tokens over a 300-token cache (a decode step and a 5-draft verify step);
  * greedy `quasar=True` generation (n-gram drafts) on the bench prompts, in tokens/s.
Bytes a step reads = int8 decoder weights + linears kept in float + lm_head; the extra bytes of a
kept-float checkpoint are its price, and the step time says what they cost here.

    python scripts/keep_float_price.py default=DIR_A keepauto=DIR_B --name keep_float_price_smollm2_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quasar_hf  # noqa: F401  (registers the quantizer)
from quasar_hf.bench.fidelity import speculative_tokens
from quasar_hf.bench.suites import load_suites, render_prompt
from quasar_hf.nn import W8A8Linear
from quasar_hf.speculative.kv_state import RowAlignedCache

CACHE_TOKENS = 300


def parse_checkpoint(text: str) -> tuple[str, str]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise SystemExit(f"{text!r}: write label=DIR, e.g. keepauto=/ckpt/model-keep-float")
    path = os.path.expanduser(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"{label}: {path} is not a saved checkpoint folder (no config.json); save one with quasar-hf quantize")
    return label, path


def step_bytes(model: torch.nn.Module) -> dict:
    """Bytes one forward reads: int8 decoder weights, kept-float linears, lm_head."""
    qconfig = model.config.quantization_config
    info = qconfig.get("keep_float_info") if isinstance(qconfig, dict) else getattr(qconfig, "keep_float_info", None)
    kept_names = set((info or {}).get("modules", []))
    int8 = sum(m.weight.numel() for m in model.modules() if isinstance(m, W8A8Linear))
    kept = sum(m.weight.numel() * m.weight.element_size() for name, m in model.named_modules() if name in kept_names)
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return {"int8_bytes": int8, "kept_float_bytes": kept, "kept_float_linears": len(kept_names), "lm_head_bytes": head}


@torch.no_grad()
def step_time_ms(model: torch.nn.Module, tokens: int, steps: int, generator: torch.Generator) -> float:
    """Median time of one forward of `tokens` tokens over a CACHE_TOKENS-token cache (rolled back each time)."""
    state = RowAlignedCache(model, 1, torch.device("cpu"))
    vocab = model.config.vocab_size
    state.forward(torch.randint(0, vocab, (1, CACHE_TOKENS), generator=generator))
    times = []
    for i in range(steps + 1):
        ids = torch.randint(0, vocab, (1, tokens), generator=generator)
        start = time.perf_counter()
        state.forward(ids)
        elapsed = time.perf_counter() - start
        state.keep_appended(torch.tensor([0]), tokens)  # back to the same cache
        if i:  # the first is a warm-up
            times.append(elapsed * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help="label=DIR of saved Quasar checkpoints of one model")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every measurement")
    parser.add_argument("--steps", type=int, default=10, help="forwards per step-time measurement")
    parser.add_argument("--prompts", type=int, default=2, help="bench prompts per suite for generation")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the first checkpoint's)")
    parser.add_argument("--out", default="benchmarks")
    parser.add_argument("--name", default="keep_float_price_cpu")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.prompts < 1 or args.max_new_tokens < 1:
        raise SystemExit("--rounds, --steps, --prompts and --max-new-tokens must be >= 1")
    labels = dict(parse_checkpoint(c) for c in args.checkpoints)
    models = {label: AutoModelForCausalLM.from_pretrained(path).eval() for label, path in labels.items()}
    tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(args.tokenizer or next(iter(labels.values()))))
    prompts = [torch.tensor([render_prompt(item, tokenizer)]) for item in load_suites("all", args.prompts)]

    samples = {label: {"step_1_ms": [], "step_6_ms": [], "tokens": 0, "seconds": 0.0, "outputs": []} for label in models}
    generator = torch.Generator().manual_seed(0)
    for round_index in range(args.rounds):
        for label, model in models.items():
            record = samples[label]
            record["step_1_ms"].append(step_time_ms(model, 1, args.steps, generator))
            record["step_6_ms"].append(step_time_ms(model, 6, args.steps, generator))
            for prompt in prompts:
                start = time.perf_counter()
                tokens, _ = speculative_tokens(model, prompt, args.max_new_tokens, "ngram", 5)
                record["seconds"] += time.perf_counter() - start
                record["tokens"] += len(tokens)
                if round_index == 0:
                    record["outputs"].append(tokens)
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    rows = []
    for label, model in models.items():
        record = samples[label]
        rows.append(
            {
                "label": label,
                "checkpoint": labels[label],
                **step_bytes(model),
                "step_1_ms": statistics.median(record["step_1_ms"]),
                "step_6_ms": statistics.median(record["step_6_ms"]),
                "quasar_tokens_per_s": record["tokens"] / record["seconds"],
                "same_tokens_as_first": record["outputs"] == samples[rows[0]["label"]]["outputs"] if rows else True,
            }
        )
    from quasar_hf.bench.report import environment

    result = {
        "command": "python scripts/keep_float_price.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "environment": environment(),
        "settings": {"rounds": args.rounds, "steps": args.steps, "cache_tokens": CACHE_TOKENS, "prompts": len(prompts)}
        | {"max_new_tokens": args.max_new_tokens, "drafter": "ngram", "num_draft_tokens": 5},
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    json_path, md_path = (os.path.join(args.out, f"{args.name}.{ext}") for ext in ("json", "md"))
    with open(json_path, "w") as fh:
        json.dump(result, fh, indent=1)
    with open(md_path, "w") as fh:
        fh.write(to_markdown(result))
    return [json_path, md_path]


def to_markdown(result: dict) -> str:
    rows, first = result["rows"], result["rows"][0]
    from quasar_hf.bench.report import title_and_command

    lines = title_and_command("Price of keep_float: bytes per step, step time, tokens/s", result["command"])
    lines += [
        "| checkpoint | int8 MB | kept float MB (linears) | lm_head MB | bytes vs first | 1-token step ms | 6-token step ms "
        "| quasar=True tok/s | vs first | same tokens as first |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    total = lambda r: r["int8_bytes"] + r["kept_float_bytes"] + r["lm_head_bytes"]  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['int8_bytes'] / 1e6:.1f} | {r['kept_float_bytes'] / 1e6:.1f} ({r['kept_float_linears']}) | "
            f"{r['lm_head_bytes'] / 1e6:.1f} | {total(r) / total(first):.3f}x | {r['step_1_ms']:.1f} | {r['step_6_ms']:.1f} | "
            f"{r['quasar_tokens_per_s']:.1f} | {r['quasar_tokens_per_s'] / first['quasar_tokens_per_s']:.3f}x | "
            f"{'yes' if r['same_tokens_as_first'] else 'no'} |"
        )
    s = result["settings"]
    lines += [
        "",
        f"Medians of {s['rounds']} interleaved rounds; each step time is the median of {s['steps']} forwards over a "
        f"{s['cache_tokens']}-token cache. Generation: {s['prompts']} bench prompts, {s['max_new_tokens']} new tokens, "
        "n-gram drafts of 5, greedy. Different checkpoints are different models: their tokens may differ.",
        "",
        "Environment: "
        + json.dumps(
            {k: result["environment"].get(k) for k in ("cpu", "cpu_count", "torch_threads", "load_average", "git_commit")}
        ),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    for written in main():
        print(written)
