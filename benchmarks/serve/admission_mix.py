"""Admission policies compared in one process: waves of requests sent at once, half short and half long, through
the serving scheduler (RequestBatcher) with no HTTP in between, each policy's rounds interleaved with the others'.

    python -m benchmarks admission-mix --quantized DIR [--rounds 2] [--waves 3] [--out DIR --name NAME]

Per policy and round: a short request's latency alone (median of 3), then `--waves` waves of `--clients`
requests submitted together, even ones asking `--short-tokens` and odd ones `--long-tokens`; the short and the
long requests' median latency (submission to their last token). Prompts are chat-rendered word passages when
the checkpoint has a tokenizer with a chat template, else fixed random token ids. The serve-shapes benchmark
measures the same shape over HTTP, where requests reach the scheduler one by one.

The model loads in a thread that ends with the load, as the server loads it: a thread that stays alive after
running torch ops keeps its OpenMP team, and beside the scheduler's own team libgomp then stops spinning between
parallel regions (own_thread.py), which halved every step here before (SmolLM2 one client 45 tokens/s against 80).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import quasar_hf  # noqa: F401  (registers the Quasar model classes)
from quasar_hf.bench.report import environment, write_json_and_markdown
from quasar_hf.speculative.admission import AdmissionPolicy
from quasar_hf.speculative.batch_request import BatchRequest
from quasar_hf.speculative.batcher import RequestBatcher
from quasar_hf.speculative.own_thread import in_own_thread

POLICIES = {
    # every request counts as held long: oldest first, none held
    "first come first served": AdmissionPolicy(fair_wait_s=0.0, scale_fair_wait=False),
    "fewest asked first, hold from 1 row": AdmissionPolicy(hold_rows=1),
    "fewest asked first, hold from 2 rows (default)": AdmissionPolicy(),
    "fewest asked first, hold from 3 rows": AdmissionPolicy(hold_rows=3),
}
WORDS = "the river carried small boats past old mills while traders counted grain and children ran along the bank".split()


def prompt_ids(tokenizer, vocab_size: int, index: int, words: int) -> list[int]:
    """Request `index`'s prompt: a chat-rendered passage, or random ids where there is no chat template."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        passage = " ".join(WORDS[(index * 7 + j) % len(WORDS)] for j in range(words))
        message = [{"role": "user", "content": f"Note {index}: summarize this passage. {passage}"}]
        return tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    generator = torch.Generator().manual_seed(index)
    return torch.randint(3, vocab_size, (words,), generator=generator).tolist()


def served(batcher: RequestBatcher, prompts: list[list[int]], budgets: list[int]) -> list[float]:
    """Submit the requests together; each one's seconds from submission to its end."""
    ended: dict[int, float] = {}
    events = [threading.Event() for _ in prompts]

    def done(index: int):
        return lambda error: (ended.__setitem__(index, time.perf_counter()), events[index].set())

    requests = [
        BatchRequest(ids, GenerationConfig(max_new_tokens=n, do_sample=False), lambda tokens: None, done(i))
        for i, (ids, n) in enumerate(zip(prompts, budgets))
    ]
    started = time.perf_counter()
    for request in requests:
        batcher.submit(request)
    if not all(event.wait(600) for event in events):
        raise RuntimeError("a request did not finish within 600 s")
    return [ended[i] - started for i in range(len(prompts))]


def measure(model, args, policy: AdmissionPolicy, prompt_of) -> dict:
    batcher = RequestBatcher(model, admission=policy)
    try:
        alone = [served(batcher, [prompt_of(1000 + k)], [args.short_tokens])[0] for k in range(3)]
        shorts, longs = [], []
        for wave in range(args.waves):
            budgets = [args.short_tokens if i % 2 == 0 else args.long_tokens for i in range(args.clients)]
            seconds = served(batcher, [prompt_of(wave * args.clients + i) for i in range(args.clients)], budgets)
            shorts += seconds[0::2]
            longs += seconds[1::2]
    finally:
        batcher.stop()
    short, alone_s = statistics.median(shorts), statistics.median(alone)
    return {
        "short_alone_s": round(alone_s, 3),
        "short_p50_s": round(short, 3),
        "short_over_alone": round(short / alone_s, 2),
        "long_p50_s": round(statistics.median(longs), 3),
    }


def to_markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Admission policies: short requests among long ones, in one process",
        "",
        f"`{report['command']}`",
        "",
        f"{s['clients']} requests at once, half asking {s['short_tokens']} tokens and half {s['long_tokens']}; "
        f"{s['waves']} waves per round, rounds interleaved across policies (median latencies, seconds).",
        "",
        "| round | policy | short alone | short in the mix | mix / alone | long in the mix |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['round']} | {row['policy']} | {row['short_alone_s']} | {row['short_p50_s']} | "
            f"{row['short_over_alone']} | {row['long_p50_s']} |"
        )
    lines += ["", f"Environment: {report['environment']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks admission-mix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantized", required=True, help="a saved Quasar checkpoint")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, default=60)
    parser.add_argument("--policies", nargs="*", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--out", default="out/admission_mix")
    parser.add_argument("--name", default="admission_mix")
    args = parser.parse_args(argv)
    model = in_own_thread(lambda: AutoModelForCausalLM.from_pretrained(args.quantized).eval()).result()  # see above
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.quantized)
    except (OSError, ValueError):
        tokenizer = None
    cache: dict[int, list[int]] = {}

    def prompt_of(index: int) -> list[int]:
        return cache.setdefault(index, prompt_ids(tokenizer, model.config.vocab_size, index, args.prompt_words))

    rows = []
    for round_index in range(args.rounds):
        for name in args.policies:
            row = {"round": round_index + 1, "policy": name, **measure(model, args, POLICIES[name], prompt_of)}
            print(row, flush=True)
            rows.append(row)
    settings = {k: getattr(args, k) for k in ("rounds", "waves", "clients", "short_tokens", "long_tokens", "prompt_words")}
    command = "python -m benchmarks admission-mix " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {"command": command.strip(), "settings": settings, "rows": rows, "environment": environment()}
    return write_json_and_markdown(report, args.out, args.name, to_markdown)


if __name__ == "__main__":
    main()
