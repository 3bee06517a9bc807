"""What compiled generation costs when a process meets new shapes, and that it stays exact.

    python -m benchmarks compiled-shapes --quantized DIR --name compiled_shapes_smollm2_epyc_avx2

One process calls compiled `quasar=True` and compiled plain greedy decoding (`num_draft_tokens=0`)
on the same prompts for each (batch size, new tokens) in `--calls`, in order. Each row records the
shape key the call ran (batch rounded to a power of two, cache slots), whether that key was new
(its graphs compiled during the quasar call), the quasar call's wall time, the plain call's, and
whether the two outputs are equal token for token.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks import reports_dir
from benchmarks.kernels.build_reports import write_build_reports
from quasar_hf.speculative.compiled_steps import TABLE_ATTR

PROMPTS = [
    "Rewrite in plain words: The meeting has been postponed until further notice.",
    "List three fruits and their colours.",
    "def add(a, b):\n    return",
    "Translate to French: good morning",
    "Summarize: the cat sat on the mat because it was warm.",
    "Explain what a KV cache is in one sentence.",
    "Name the planets of the solar system in order.",
    "Write a haiku about the sea.",
]
DEFAULT_CALLS = "1x8,2x8,3x8,4x8,5x8,6x8,2x300,1x8"


def parse_calls(text: str) -> list[tuple[int, int]]:
    calls = []
    for item in text.split(","):
        batch, _, tokens = item.partition("x")
        if not (batch.isdigit() and tokens.isdigit()) or not 1 <= int(batch) <= len(PROMPTS):
            raise argparse.ArgumentTypeError(f"--calls takes BATCHxTOKENS items, batch 1..{len(PROMPTS)}; got {item!r}")
        calls.append((int(batch), int(tokens)))
    return calls


def run_calls(model, tokenizer, calls: list[tuple[int, int]], compile_config=True) -> list[dict]:
    tokenizer.padding_side = "left"
    rows = []
    for batch, tokens in calls:
        encoded = tokenizer(PROMPTS[:batch], return_tensors="pt", padding=True)
        options = dict(attention_mask=encoded.attention_mask, max_new_tokens=tokens, do_sample=False)
        table = model.__dict__.get(TABLE_ATTR)
        before = table.compiled_keys if table is not None else 0
        started = time.perf_counter()
        quasar = model.generate(encoded.input_ids, quasar={"compile": compile_config}, **options)
        quasar_s = time.perf_counter() - started
        started = time.perf_counter()
        plain = model.generate(encoded.input_ids, quasar={"compile": compile_config, "num_draft_tokens": 0}, **options)
        plain_s = time.perf_counter() - started
        table = model.__dict__[TABLE_ATTR]
        rows.append(
            {
                "batch": batch,
                "new_tokens": tokens,
                "key": list(next(reversed(table.steps))),
                "new_key": table.compiled_keys > before,
                "quasar_s": round(quasar_s, 2),
                "plain_s": round(plain_s, 2),
                "equal": bool(torch.equal(quasar, plain)),
                "keys_kept": len(table.steps),
            }
        )
        print(rows[-1], flush=True)
    return rows


def to_markdown(result: dict, command: str) -> str:
    lines = [
        "# Compiled generation over changing shapes",
        "",
        f"`{command}`",
        "",
        f"Checkpoint: `{result['checkpoint']}`. Times are one call each, wall clock; a new key compiles its graphs inside the quasar call.",
        "",
        "| batch | new tokens | key (rows, slots) | new key | compiled quasar s | compiled plain s | equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['new_tokens']} | {tuple(r['key'])} | {'yes' if r['new_key'] else 'no'} | "
            f"{r['quasar_s']} | {r['plain_s']} | {'yes' if r['equal'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks compiled-shapes", description=__doc__)
    parser.add_argument("--quantized", required=True, help="a saved Quasar checkpoint folder")
    parser.add_argument(
        "--mixed", action="store_true", help="warm up once, then a shuffled sequence (benchmarks/speed/compiled_mixed.py)"
    )
    parser.add_argument("--mixed-calls", type=int, default=20, help="--mixed: calls in the sequence")
    parser.add_argument("--seed", type=int, default=0, help="--mixed: the shuffle")
    parser.add_argument("--new-tokens", type=int, default=64, help="--mixed: new tokens per call")
    parser.add_argument("--max-length", type=int, default=4096, help="--mixed: the warm-up's longest call")
    parser.add_argument("--llama-server", help="--mixed: llama.cpp's llama-server binary")
    parser.add_argument("--gguf", help="--mixed: a Q8_0 GGUF of the same model")
    parser.add_argument(
        "--llama-modes", default="plain,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache", type=lambda s: s.split(",")
    )
    parser.add_argument("--calls", type=parse_calls, default=parse_calls(DEFAULT_CALLS), help=f"default {DEFAULT_CALLS}")
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"], help="aot_eager: graphs only (tests)")
    parser.add_argument("--out", default=reports_dir("compiled-shapes"))
    parser.add_argument("--name", default="compiled_shapes")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

    import quasar_hf  # noqa: F401  (registers the quantization method)

    if args.mixed:
        from benchmarks.speed.compiled_mixed import mixed_main, mixed_markdown

        return write_build_reports(mixed_main(args), args.out, args.name, parser.prog, argv, mixed_markdown)

    compile_config = True if args.backend == "inductor" else CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager")
    model = AutoModelForCausalLM.from_pretrained(args.quantized)
    tokenizer = AutoTokenizer.from_pretrained(args.quantized)
    rows = run_calls(model, tokenizer, args.calls, compile_config)
    result = {"checkpoint": args.quantized, "backend": args.backend, "rows": rows, "all_equal": all(r["equal"] for r in rows)}
    return write_build_reports(result, args.out, args.name, parser.prog, argv, to_markdown)
