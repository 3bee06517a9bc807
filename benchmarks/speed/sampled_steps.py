"""Steps of the serving engine with sampled rows: DecodeEngine on a saved checkpoint, N rows of different seeds
(do_sample, temperature, top_p), each step timed; `--profile` prints where the steps' time goes (cProfile).

    python -m benchmarks.speed.sampled_steps --quantized DIR [--rows 4] [--steps 40] [--repeats 3] [--profile]

A quick measurement for a code change on a shared machine (not a report): compare medians of repeats taken
in one process or one after another, never one run's numbers alone.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import quasar_hf  # noqa: F401  (registers the Quasar model classes)
from quasar_hf.speculative.batch_request import BatchRequest
from quasar_hf.speculative.engine import DecodeEngine
from quasar_hf.speculative.request_config import request_quasar_config

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works, with an example in Python.",
    "List ten ideas for a weekend trip near the mountains and say why each is fun.",
    "Describe the water cycle to a ten year old.",
    "What are the pros and cons of electric cars? Answer in detail.",
    "Write a poem about autumn leaves falling in a quiet park.",
    "Summarize the plot of a detective novel you invent on the spot.",
    "Give step by step instructions to bake bread at home.",
]


def requests(tokenizer, rows: int, max_new_tokens: int, options: dict) -> list[tuple[BatchRequest, list[int]]]:
    """`rows` sampled requests, each with its own seeded generator; their token lists."""
    out = []
    for i in range(rows):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text)["input_ids"]
        tokens: list[int] = []
        config = GenerationConfig(max_new_tokens=max_new_tokens, **options)
        request = BatchRequest(list(ids), config, tokens.extend, lambda error: None)
        request.generator = torch.Generator().manual_seed(1000 + i)
        out.append((request, tokens))
    return out


def timed_steps(model, tokenizer, args, options: dict, profile: cProfile.Profile | None = None) -> tuple[list, list, list, list]:
    """Each step's seconds while every row decodes (wall, the process's CPU), the wall part of each past its verify
    forward, each row's tokens."""
    after: list[float] = []  # each step's seconds past its verify forward: scores, drawing, emitting
    engine = DecodeEngine(model, on_stats=lambda stats, rows: rows and after.append(stats.verify_time_s - stats.forward_time_s))
    made = requests(tokenizer, args.rows, args.steps * 8 + 64, options)
    for request, _ in made:
        engine.add(request, request_quasar_config(model, request.generation_config, None))
    times, cpu_times = [], []
    for _ in range(args.steps):
        if engine.rows < args.rows:
            break
        if profile is not None:
            profile.enable()
        started, cpu = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu)
        if profile is not None:
            profile.disable()
    engine.close()
    return times, cpu_times, after, [tokens for _, tokens in made]


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.1f}/{min(values) * 1e3:.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantized", required=True)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--greedy", action="store_true", help="greedy rows instead (the cost without processors)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.quantized).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.quantized)
    options = {"do_sample": False} if args.greedy else {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    with torch.no_grad():
        timed_steps(model, tokenizer, argparse.Namespace(**{**vars(args), "steps": 3}), options)  # warm up
        for repeat in range(args.repeats):
            times, cpu_times, after, tokens = timed_steps(model, tokenizer, args, options)
            checksum = hash(tuple(tuple(t) for t in tokens)) & 0xFFFFFFFF
            print(
                f"repeat {repeat}: {len(times)} steps of {args.rows} rows (median/min ms): step {_ms(times)}, "
                f"its CPU {_ms(cpu_times)}, past the forward {_ms(after)}; tokens {sum(map(len, tokens))}, "
                f"checksum {checksum:08x}",
                flush=True,
            )
        if args.profile:
            profile = cProfile.Profile()
            timed_steps(model, tokenizer, args, options, profile)
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
