"""Three load shapes on `quasar-hf serve` (and on `llama-server -np 8` when given): short requests among long
ones, requests arriving at a steady rate, sampled requests from 1 and 4 clients. Not a test: a bounded load run.

    python -m benchmarks serve-shapes --model smollm2 --out DIR [--llama-server BIN --gguf FILE]
    python -m benchmarks serve-shapes --tiny --out DIR          # mechanics: a tiny checkpoint

mixed: --repeats short requests (--short-tokens greedy tokens) one at a time, then --mix-waves waves of
--clients requests sent at once, half asking --short-tokens and half --long-tokens; the short ones' median
latency in the mix over their median alone (target <= 2), the long ones' latency, aggregate tokens/s.
arrivals: with the server idle, --repeats requests one at a time (time to first token, TTFT, and the mean
time between tokens, one step); then a new request every --interval s for --duration s; TTFT p50 / p90
over (alone TTFT + 2 steps) (target <= 1). sampled: temperature / top_p with a seed per request,
--sampled-requests per client from 1 then 4 clients; aggregate tokens/s at 4 over 1 (target >= 2.5).
Every request is a distinct user message (an instruction and a passage of held-out text) sent through the
chat endpoint, so the server's chat template renders it; all are streamed, each on its own connection with a
--request-timeout, and a request due after its shape's --shape-timeout is not sent. Every shape counts its
failed requests (target 0). One server runs at a time.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.serve.serve_clients import Outcome, Prompt, ServerProcess, Wire, free_port, from_clients, request_once
from benchmarks.serve.serve_load import percentile, tiny_checkpoints
from quasar_hf.bench.report import markdown_table, write_json_and_markdown

SHAPES = ("mixed", "arrivals", "sampled")
TASKS = (
    "Summarize this passage in one sentence",
    "Explain this passage to a beginner",
    "List the main ideas of this passage",
    "Write a question a reader might ask about this passage, then answer it",
    "Give this passage a short title and say why it fits",
)


def natural_prompts(words: int) -> Iterator[list[dict]]:
    """Endless distinct chat requests: an instruction and the next `words` words of held-out text."""
    from quasar_hf.smoothquant.builtin_text import mix_texts

    corpus = " ".join(mix_texts("heldout")).split()
    for index in itertools.count():
        start = (index * words) % len(corpus)
        passage = " ".join((corpus + corpus)[start : start + words])
        yield [{"role": "user", "content": f"{TASKS[index % len(TASKS)]}:\n\n{passage}"}]


@dataclass(frozen=True)
class Budget:
    """How long a request may wait on its server (`request_s`: the socket timeout) and when its shape must
    end (`deadline`, on time.monotonic()): a request due past the deadline is not sent, and counts as failed."""

    request_s: float
    deadline: float

    def socket_timeout(self) -> float | None:
        """Seconds a request sent now may wait for each read (None: past the deadline, send nothing)."""
        left = self.deadline - time.monotonic()
        return None if left <= 0 else min(self.request_s, max(left, 1.0))


def ask(port: int, model: str, messages: list[dict], max_tokens: int, sampling: dict, budget: Budget) -> Outcome:
    """One streamed chat request on its own connection (greedy unless `sampling` says otherwise), timed."""
    timeout = budget.socket_timeout()
    if timeout is None:
        return Outcome("chat", time.perf_counter(), error="not sent: its shape ran past --shape-timeout")
    wire = Wire("openai", model, {**sampling, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        return request_once(connection, wire, Prompt("chat", [], messages), max_tokens)
    finally:
        connection.close()


def finished(outcomes: list[Outcome | None]) -> list[Outcome]:
    """The requests that ended without an error (None: a request still running at its shape's deadline)."""
    return [o for o in outcomes if o is not None and o.error is None and o.ended is not None]


def latencies(outcomes: list[Outcome | None]) -> list[float]:
    return [o.ended - o.started for o in finished(outcomes)]


def first_token_times(outcomes: list[Outcome | None]) -> list[float]:
    return [o.first_token - o.started for o in finished(outcomes) if o.first_token is not None]


def inter_token_s(outcome: Outcome) -> float | None:
    """Mean seconds between a response's tokens after its first (None with fewer than 2 tokens)."""
    if outcome.first_token is None or outcome.ended is None or outcome.tokens < 2:
        return None
    return (outcome.ended - outcome.first_token) / (outcome.tokens - 1)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def counts(outcomes: list[Outcome | None]) -> dict:
    """Requests, failures (with up to three distinct errors) and tokens of a group of requests."""
    done = finished(outcomes)
    errors = sorted({o.error for o in outcomes if o is not None and o.error})[:3]
    unfinished = sum(o is None or (o.error is None and o.ended is None) for o in outcomes)
    errors += ["still running at the deadline"] * bool(unfinished)
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(done),
        "errors": errors,
        "tokens": sum(o.tokens for o in done),
    }


def from_jobs(
    port: int, model: str, jobs: list[tuple[list[dict], int, dict]], clients: int, budget: Budget
) -> tuple[list[Outcome | None], float]:
    """Every (messages, max_tokens, sampling) job from `clients` concurrent clients (each sends its next job
    when its last has ended; clients = len(jobs): all at once): the outcomes and the wall time."""
    outcomes: list[Outcome | None] = [None] * len(jobs)

    def one(index: int) -> None:
        outcomes[index] = ask(port, model, *jobs[index], budget)

    return outcomes, from_clients(len(jobs), clients, one)


def one_by_one(port: int, model: str, pool: Iterator[list[dict]], count: int, max_tokens: int, budget: Budget) -> list[Outcome]:
    """`count` greedy requests, each sent when the last has ended (the server otherwise idle)."""
    return [ask(port, model, next(pool), max_tokens, {}, budget) for _ in range(count)]


def shape_mixed(port: int, model: str, pool: Iterator[list[dict]], args, budget: Budget) -> dict:
    """Short requests alone, then waves of short and long requests sent together."""
    alone = one_by_one(port, model, pool, args.repeats, args.short_tokens, budget)
    short, long, tokens, wall = [], [], 0, 0.0
    for _ in range(args.mix_waves):
        lengths = [args.short_tokens if i % 2 == 0 else args.long_tokens for i in range(args.clients)]
        jobs = [(next(pool), n, {}) for n in lengths]
        outcomes, seconds = from_jobs(port, model, jobs, len(jobs), budget)
        short += outcomes[0::2]
        long += outcomes[1::2]
        tokens, wall = tokens + sum(o.tokens for o in finished(outcomes)), wall + seconds
    alone_p50, mix_p50 = median(latencies(alone)), median(latencies(short))
    return {
        "alone": {**counts(alone), "latency_p50_s": rounded(alone_p50)},
        "short": {
            **counts(short),
            "latency_p50_s": rounded(mix_p50),
            "latency_max_s": rounded(max(latencies(short), default=None)),
        },
        "long": {**counts(long), "latency_p50_s": rounded(median(latencies(long)))},
        "short_mix_over_alone": rounded(ratio(mix_p50, alone_p50)),
        "tokens_per_s": rounded(tokens / wall if wall else None, 2),
        "wall_s": round(wall, 2),
        "failed": sum(counts(group)["failed"] for group in (alone, short, long)),
    }


def arrive(port: int, model: str, prompts: list[list[dict]], args, budget: Budget) -> tuple[list[Outcome | None], list[float]]:
    """Send prompts[k] at k * --interval seconds (open loop: whatever is still running); wait at most
    --request-timeout after the last one, and not past the shape's deadline. The outcomes (None: still
    running) and each send time."""
    outcomes: list[Outcome | None] = [None] * len(prompts)
    sent: list[float] = []

    def one(index: int) -> None:
        outcomes[index] = ask(port, model, prompts[index], args.arrival_tokens, {}, budget)

    threads, start = [], time.perf_counter()
    for index in range(len(prompts)):
        time.sleep(max(0.0, start + index * args.interval - time.perf_counter()))
        sent.append(time.perf_counter() - start)
        threads.append(threading.Thread(target=one, args=(index,), daemon=True))
        threads[-1].start()
    deadline = min(budget.deadline, time.monotonic() + budget.request_s)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return list(outcomes), sent


def arrival_row(outcome: Outcome | None, sent_s: float) -> dict:
    """One arrival for the report: when it was sent, its TTFT and latency (None: it failed), its tokens."""
    row = {"sent_s": round(sent_s, 3), "ttft_s": None, "latency_s": None, "tokens": 0}
    if finished([outcome]):
        row["latency_s"], row["tokens"] = round(outcome.ended - outcome.started, 3), outcome.tokens
        row["ttft_s"] = None if outcome.first_token is None else round(outcome.first_token - outcome.started, 3)
    return row


def shape_arrivals(port: int, model: str, pool: Iterator[list[dict]], args, budget: Budget) -> dict:
    """TTFT and step alone, then a steady stream of arrivals; TTFT under arrivals over alone TTFT + 2 steps."""
    alone = one_by_one(port, model, pool, args.repeats, args.arrival_tokens, budget)
    alone_ttft = median(first_token_times(alone))
    step = median([s for s in map(inter_token_s, finished(alone)) if s is not None])
    target = None if alone_ttft is None or step is None else alone_ttft + 2 * step
    prompts = [next(pool) for _ in range(max(1, round(args.duration / args.interval)))]
    outcomes, sent = arrive(port, model, prompts, args, budget)
    ttfts, ends = first_token_times(outcomes), latencies(outcomes)
    return {
        "alone": {**counts(alone), "ttft_s": rounded(alone_ttft, 4), "step_s": rounded(step, 4), "target_s": rounded(target, 4)},
        **counts(outcomes),
        "ttft_p50_s": rounded(median(ttfts)),
        "ttft_p90_s": rounded(percentile(ttfts, 0.9)),
        "latency_p50_s": rounded(median(ends)),
        "latency_p90_s": rounded(percentile(ends, 0.9)),
        "ttft_p50_over_target": rounded(ratio(median(ttfts), target)),
        "ttft_p90_over_target": rounded(ratio(percentile(ttfts, 0.9), target)),
        "failed": counts(alone)["failed"] + counts(outcomes)["failed"],
        "rows": [arrival_row(o, at) for o, at in zip(outcomes, sent)],
    }


def shape_sampled(port: int, model: str, pool: Iterator[list[dict]], args, budget: Budget) -> dict:
    """Seeded temperature / top_p requests from 1 client, then from 4; aggregate tokens/s of each and their ratio."""
    levels, seeds = {}, itertools.count()
    for clients in (1, 4):
        sampling = [
            {"temperature": args.temperature, "top_p": args.top_p, "seed": next(seeds)}
            for _ in range(clients * args.sampled_requests)
        ]
        jobs = [(next(pool), args.sampled_tokens, options) for options in sampling]
        outcomes, wall = from_jobs(port, model, jobs, clients, budget)
        summary = counts(outcomes)
        levels[str(clients)] = {**summary, "wall_s": round(wall, 2), "tokens_per_s": round(summary["tokens"] / wall, 2)}
    return {
        "levels": levels,
        "four_over_one": rounded(ratio(levels["4"]["tokens_per_s"], levels["1"]["tokens_per_s"])),
        "failed": sum(level["failed"] for level in levels.values()),
    }


RUNS = {"mixed": shape_mixed, "arrivals": shape_arrivals, "sampled": shape_sampled}


def server_commands(args, checkpoint: str) -> dict[str, list[str]]:
    """Each server's command line, without its port (added last, after `--port`)."""
    ours = [sys.executable, "-m", "quasar_hf.cli", "serve", checkpoint, *shlex.split(args.server_args), "--port"]
    servers = {"quasar": ours}
    if args.llama_server and args.gguf:  # as serve-chat starts it: 8 slots, cache_prompt on (its default)
        threads = str(torch.get_num_threads())
        servers["llama_server"] = [args.llama_server, "-m", args.gguf, "-t", threads, "-np", "8", "-c", "32768", "--port"]
    return servers


def measure_server(label: str, command: list[str], checkpoint: str, args, out: Path) -> dict:
    """Start one server, warm it with one untimed request, run each shape on it in turn, stop it."""
    port = free_port()
    pool = natural_prompts(args.prompt_words)  # the same prompts, in the same order, for every server
    try:
        server = ServerProcess([*command, str(port)], port, out / f"{args.name}_{label}.log", timeout_s=900)
    except RuntimeError as error:  # it did not start (a missing binary or GGUF, a checkpoint it cannot load)
        return {"skipped": str(error)[:500]}
    with server:
        warm_up = Budget(args.request_timeout, time.monotonic() + args.request_timeout)
        ask(port, checkpoint, next(pool), args.short_tokens, {}, warm_up)
        result: dict = {"start_s": round(server.ready_s, 1)}
        for shape in args.shapes:
            started, budget = time.perf_counter(), Budget(args.request_timeout, time.monotonic() + args.shape_timeout)
            result[shape] = RUNS[shape](port, checkpoint, pool, args, budget)
            result[shape]["shape_wall_s"] = round(time.perf_counter() - started, 1)
            print(f"  {label} {shape}: {result[shape]['failed']} failed", flush=True)
    return result


def prompt_tokens(checkpoint: str, words: int) -> int:
    """A typical request's prompt tokens once the chat template renders it (our checkpoint's tokenizer)."""
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        next(natural_prompts(words)), add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return len(rendered["input_ids"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks serve-shapes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="what `quasar-hf serve` takes (default: the embedded SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="mechanics only: a tiny random Quasar checkpoint made in --out")
    parser.add_argument("--shapes", default=",".join(SHAPES), type=lambda text: [s for s in text.split(",") if s])
    parser.add_argument(
        "--server-args", default="", help="more `quasar-hf serve` options, one string (e.g. '--prompt-cache-gb 0')"
    )
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary: the same shapes on it")
    parser.add_argument("--gguf", help="the GGUF llama-server serves (the same model)")
    parser.add_argument("--prompt-words", type=int, default=40, help="held-out words in each request's passage")
    parser.add_argument("--repeats", type=int, default=5, help="requests timed alone (mixed, arrivals)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may wait on its server")
    parser.add_argument("--shape-timeout", type=float, default=900.0, help="seconds a shape may run; later requests fail")
    parser.add_argument("--clients", type=int, default=8, help="mixed: requests sent at once, half short, half long")
    parser.add_argument("--mix-waves", type=int, default=3)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=256)
    parser.add_argument("--interval", type=float, default=0.5, help="arrivals: seconds between two requests")
    parser.add_argument("--duration", type=float, default=60.0, help="arrivals: seconds of arrivals")
    parser.add_argument("--arrival-tokens", type=int, default=64)
    parser.add_argument("--sampled-requests", type=int, default=8, help="sampled: requests per client")
    parser.add_argument("--sampled-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="serve_shapes")
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {','.join(SHAPES)}")
    return args


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    from quasar_hf.commands.serve import servable_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = tiny_checkpoints(out)[1] if args.tiny else servable_checkpoint(args.model)
    result = {
        "command": "python -m benchmarks serve-shapes " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "checkpoint": checkpoint,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "name")},
        "prompt_tokens": prompt_tokens(checkpoint, args.prompt_words),
        "servers": {},
    }
    for label, command in server_commands(args, checkpoint).items():
        print(f"serve-shapes: {label}", flush=True)
        result["servers"][label] = measure_server(label, command, checkpoint, args, out)
        paths = write_json_and_markdown(result, out, args.name, to_markdown)
    return paths


def to_markdown(result: dict) -> str:
    s, servers = result["settings"], result["servers"]
    ran = {label: run for label, run in servers.items() if "skipped" not in run}
    lines = ["# Load shapes: quasar-hf serve (and llama-server)", "", f"`{result['command']}`", ""]
    lines += [f"Every prompt distinct, about {result['prompt_tokens']} tokens through the chat template.", ""]
    skipped = [f"- {label}: skipped ({run['skipped'][:200]})" for label, run in servers.items() if label not in ran]
    lines += [*skipped, ""] if skipped else []
    for shape, table in (("mixed", mixed_table), ("arrivals", arrivals_table), ("sampled", sampled_table)):
        runs = {label: run[shape] for label, run in ran.items() if shape in run}
        if runs:
            lines += [*table(runs, s), ""]
    lines += [f"Environment: {result.get('environment')}", ""]
    return "\n".join(lines)


def mixed_table(runs: dict[str, dict], s: dict) -> list[str]:
    title = f"Mixed: {s['short_tokens']}-token requests alone, then {s['clients']} at once, half {s['short_tokens']} and half"
    header = ["server", "short alone p50 s", "short in the mix p50 s", "mix / alone (<= 2)", "long p50 s", "tokens/s", "failed"]
    rows = [
        [label, m["alone"]["latency_p50_s"], m["short"]["latency_p50_s"], m["short_mix_over_alone"]]
        + [m["long"]["latency_p50_s"], m["tokens_per_s"], m["failed"]]
        for label, m in runs.items()
    ]
    return [f"{title} {s['long_tokens']} tokens (waves: {s['mix_waves']}):", "", *markdown_table(header, rows)]


def arrivals_table(runs: dict[str, dict], s: dict) -> list[str]:
    title = f"Arrivals: one {s['arrival_tokens']}-token request every {s['interval']} s for {s['duration']} s"
    header = ["server", "requests", "TTFT p50 / p90 s", "alone TTFT s", "step s", "p50 / target (<= 1)", "p90 / target"]
    rows = [
        [label, a["requests"], f"{a['ttft_p50_s']} / {a['ttft_p90_s']}", a["alone"]["ttft_s"], a["alone"]["step_s"]]
        + [a["ttft_p50_over_target"], a["ttft_p90_over_target"], f"{a['latency_p50_s']} / {a['latency_p90_s']}", a["failed"]]
        for label, a in runs.items()
    ]
    table = markdown_table([*header, "latency p50 / p90 s", "failed"], rows)
    return [f"{title}; target = TTFT alone + 2 steps (the mean time between tokens alone):", "", *table]


def sampled_table(runs: dict[str, dict], s: dict) -> list[str]:
    title = f"Sampled: temperature {s['temperature']}, top_p {s['top_p']}, a seed per request, {s['sampled_tokens']} tokens"
    header = ["server", "1 client tokens/s", "4 clients tokens/s", "4 / 1 (>= 2.5)", "failed"]
    rows = [
        [label, x["levels"]["1"]["tokens_per_s"], x["levels"]["4"]["tokens_per_s"], x["four_over_one"], x["failed"]]
        for label, x in runs.items()
    ]
    return [f"{title} (requests per client: {s['sampled_requests']}):", "", *markdown_table(header, rows)]
