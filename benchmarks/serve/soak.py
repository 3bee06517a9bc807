"""A soak run of `quasar-hf serve`: many requests from concurrent clients, mixed lengths, some clients leaving
mid-stream; failures and the server's RSS over the run. Not a test: a bounded load run.

    python -m benchmarks serve-soak --model smollm2 --requests 2000 --clients 8 --out DIR

Request i asks for --max-tokens[i % len] new tokens (greedy) on the shipped chat, code and grounded prompts in
turn; every --leave-every-th request reads its first streamed token and closes the connection. Reported: failed
requests besides those that left, the mean RSS of the first and the last --window requests (sampled as each
ends) and their ratio, latency percentiles, and the server's own /metrics counters at the end, with
/health checked after the run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.serve.serve_clients import Outcome, Prompt, ServerProcess, Wire, free_port, from_clients, request_once, rss_bytes
from benchmarks.serve.serve_load import interleaved_prompts, percentile
from quasar_hf.bench.report import write_json_and_markdown


def leave_mid_stream(host: str, port: int, model: str, prompt: Prompt, max_tokens: int) -> Outcome:
    """A streamed request whose client closes the connection after its first token."""
    outcome = Outcome(prompt.id, time.perf_counter())
    body = {"model": model, "prompt": prompt.text, "messages": prompt.messages, "max_tokens": max_tokens, "stream": True}
    path = "/v1/chat/completions" if prompt.messages is not None else "/v1/completions"
    body = {k: v for k, v in body.items() if v is not None and not (k == "prompt" and prompt.messages is not None)}
    connection = http.client.HTTPConnection(host, port, timeout=600)
    try:
        connection.request("POST", path, json.dumps({**body, "temperature": 0}), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            outcome.error = f"HTTP {response.status}: {response.read()[:300]!r}"
        else:
            for raw in response:
                if raw.startswith(b"data: ") and b'"error"' not in raw:
                    outcome.first_token = time.perf_counter()
                    break
    except (OSError, http.client.HTTPException) as error:
        outcome.error = f"{type(error).__name__}: {error}"
    finally:
        connection.close()
    outcome.ended = time.perf_counter()
    return outcome


def run_soak(server: ServerProcess, model: str, prompts: list[Prompt], args) -> list[dict]:
    rows: list[dict | None] = [None] * args.requests
    wire = Wire("openai", model)

    def one(index: int) -> None:
        prompt, max_tokens = prompts[index % len(prompts)], args.max_tokens[index % len(args.max_tokens)]
        leaves = args.leave_every > 0 and index % args.leave_every == args.leave_every - 1
        if leaves:
            outcome = leave_mid_stream("127.0.0.1", server.port, model, prompt, max_tokens)
        else:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
            outcome = request_once(connection, wire, prompt, max_tokens)
            connection.close()
        rows[index] = {
            "index": index,
            "left": leaves,
            "max_tokens": max_tokens,
            "tokens": outcome.tokens,
            "error": outcome.error,
            "latency_s": None if outcome.ended is None else outcome.ended - outcome.started,
            "rss": rss_bytes(server.process.pid),
        }

    from_clients(args.requests, args.clients, one)
    return [row for row in rows if row is not None]


def summarize(rows: list[dict], window: int, wall_s: float) -> dict:
    failed = [row for row in rows if row["error"] and not row["left"]]
    rss = [row["rss"] for row in rows if row["rss"]]
    first, last = statistics.mean(rss[:window]), statistics.mean(rss[-window:])
    latencies = [row["latency_s"] for row in rows if row["latency_s"] is not None and not row["left"]]
    return {
        "requests": len(rows),
        "left_mid_stream": sum(row["left"] for row in rows),
        "failed": len(failed),
        "failures": [f"{row['index']}: {row['error']}" for row in failed[:20]],
        "tokens": sum(row["tokens"] for row in rows),
        "wall_s": round(wall_s, 1),
        "latency_p50_s": round(percentile(latencies, 0.5), 3),
        "latency_p95_s": round(percentile(latencies, 0.95), 3),
        "rss_first_mb": round(first / 2**20, 1),
        "rss_last_mb": round(last / 2**20, 1),
        "rss_last_over_first": round(last / first, 4),
        "rss_peak_mb": round(max(rss) / 2**20, 1),
    }


def server_counters(base: str, settle_s: float = 30.0) -> dict:
    """The quasar_* counters and gauges of /metrics (no histogram buckets), once no request is waiting or running
    (a client that left has its row stopped at the next step: wait for it, at most `settle_s`)."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + settle_s
    while True:
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            text = response.read().decode()
        busy = [line for line in text.splitlines() if line.startswith(("quasar_requests_running ", "quasar_requests_waiting "))]
        if all(float(line.split()[1]) == 0 for line in busy) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    counters = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("quasar_") and "_bucket" not in sample.name and "_created" not in sample.name:
                label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                counters[sample.name + (f"{{{label}}}" if label else "")] = sample.value
    return counters


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks serve-soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="what `quasar-hf serve` takes (default: the embedded SmolLM2)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=lambda text: [int(v) for v in text.split(",")], default=[4, 8, 16, 32])
    parser.add_argument("--leave-every", type=int, default=10, help="every Nth request leaves mid-stream (0: none)")
    parser.add_argument("--window", type=int, default=500, help="requests in the first and last RSS windows")
    parser.add_argument(
        "--server-args", default="", help="more `quasar-hf serve` options, one string (e.g. '--prompt-cache-gb 0')"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="serve_soak")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from quasar_hf.commands.serve import servable_checkpoint

    checkpoint = servable_checkpoint(args.model)
    prompts = interleaved_prompts(AutoTokenizer.from_pretrained(checkpoint), 30)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [sys.executable, "-m", "quasar_hf.cli", "serve", checkpoint, "--port", str(port), *args.server_args.split()]
    with ServerProcess(command, port, out / f"{args.name}.log", timeout_s=900) as server:
        started = time.perf_counter()
        rows = run_soak(server, checkpoint, prompts, args)
        wall_s = time.perf_counter() - started
        with urllib.request.urlopen(f"{server.base}/health", timeout=30) as response:
            healthy = response.status == 200
        counters = server_counters(server.base)
    result = {
        "command": "python -m benchmarks serve-soak " + " ".join(argv if argv is not None else sys.argv[1:]),
        "checkpoint": checkpoint,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "name")},
        "summary": summarize(rows, args.window, wall_s),
        "healthy_after": healthy,
        "server_metrics": counters,
        "rss_every_100": [row["rss"] for row in rows[::100]],
    }
    return write_json_and_markdown(result, out, args.name, to_markdown)


def to_markdown(result: dict) -> str:
    s = result["summary"]
    lines = [
        "# Soak: quasar-hf serve under many requests, some clients leaving mid-stream",
        "",
        f"`{result['command']}`",
        "",
        "| requests | clients | left mid-stream | failed (others) | tokens | wall s | latency p50 / p95 s |"
        " RSS first / last window MB | last / first | peak MB | /health after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {s['requests']} | {result['settings']['clients']} | {s['left_mid_stream']} | {s['failed']} | {s['tokens']} |"
        f" {s['wall_s']} | {s['latency_p50_s']} / {s['latency_p95_s']} | {s['rss_first_mb']} / {s['rss_last_mb']} |"
        f" {s['rss_last_over_first']} | {s['rss_peak_mb']} | {'200' if result['healthy_after'] else 'not 200'} |",
        "",
        "Server counters at the end (`/metrics`):",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {value:g} |" for name, value in sorted(result["server_metrics"].items())]
    if s["failures"]:
        lines += ["", "Failures:", "", *[f"- {failure}" for failure in s["failures"]]]
    return "\n".join(lines) + "\n"
