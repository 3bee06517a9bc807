"""What one /metrics scrape costs `quasar-hf serve`: the server's CPU seconds per scrape, measured from its own
CPU clock, and the share of decoding time a scrape every `--every` seconds can take at most.

    python -m benchmarks scrape-cost [--model smollm2 | --tiny] [--scrapes 300] [--out DIR --name NAME]

The server is started, warmed, and given `--requests` chat requests (so every counter and histogram holds
values), then left idle. Its process CPU time (/proc/PID/stat: user + system) is read over an idle window, then
over `--scrapes` scrapes sent back to back, each parsed with prometheus_client's text parser as a Prometheus
server would. CPU per scrape = (CPU over the scrapes - the idle rate x their wall time) / scrapes. A scrape
runs on the server's HTTP threads; at most all of its CPU time holds the GIL the decoding thread needs, so a
scrape every `--every` s can take at most cpu_per_scrape / every of decoding's wall time: the bound reported.
Throughput runs with and without scrapes (serve-load --scrape-metrics) differ by more than that from noise alone.
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import time
from pathlib import Path

from benchmarks.serve.load_shapes import Budget, ask, natural_prompts
from benchmarks.serve.serve_clients import ServerProcess, free_port
from benchmarks.serve.serve_load import tiny_checkpoints
from quasar_hf.bench.report import environment, write_json_and_markdown


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def scrape(port: int) -> int:
    """One GET /metrics, parsed; the number of metric families (0: it did not parse)."""
    from prometheus_client.parser import text_string_to_metric_families

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        body = response.read().decode()
        if response.status != 200:
            raise RuntimeError(f"/metrics answered {response.status}")
    finally:
        connection.close()
    return len(list(text_string_to_metric_families(body)))


def measure(port: int, pid: int, args) -> dict:
    idle_started, idle_cpu = time.perf_counter(), process_cpu_s(pid)
    time.sleep(args.idle_s)
    idle_rate = (process_cpu_s(pid) - idle_cpu) / (time.perf_counter() - idle_started)
    started, cpu = time.perf_counter(), process_cpu_s(pid)
    families = [scrape(port) for _ in range(args.scrapes)]
    wall, used = time.perf_counter() - started, process_cpu_s(pid) - cpu
    per_scrape = max(used - idle_rate * wall, 0.0) / args.scrapes
    return {
        "idle_cpu_s_per_s": round(idle_rate, 5),
        "scrapes": args.scrapes,
        "metric_families": min(families),
        "wall_ms_per_scrape": round(1e3 * wall / args.scrapes, 3),
        "server_cpu_ms_per_scrape": round(1e3 * per_scrape, 3),
        "share_at_most": round(per_scrape / args.every, 5),
        "clock_tick_ms": round(1e3 / os.sysconf("SC_CLK_TCK"), 3),
    }


def to_markdown(report: dict) -> str:
    r, s = report["result"], report["settings"]
    return "\n".join(
        [
            "# What a /metrics scrape costs quasar-hf serve",
            "",
            f"`{report['command']}`",
            "",
            f"Checkpoint: {report['checkpoint']}; {s['requests']} chat requests served first, then {s['idle_s']} s idle.",
            "",
            "| scrapes | metric families | wall ms per scrape | server CPU ms per scrape | share of decoding at one scrape every "
            f"{s['every']} s, at most | idle server CPU s/s |",
            "|---|---|---|---|---|---|",
            f"| {r['scrapes']} | {r['metric_families']} | {r['wall_ms_per_scrape']} | {r['server_cpu_ms_per_scrape']} | "
            f"{100 * r['share_at_most']:.3f} % | {r['idle_cpu_s_per_s']} |",
            "",
            f"CPU clock tick: {r['clock_tick_ms']} ms (the CPU times are sums over all scrapes).",
            "",
            f"Environment: {report['environment']}",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks scrape-cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="what `quasar-hf serve` takes (default: the embedded SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="mechanics only: a tiny random Quasar checkpoint made in --out")
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--every", type=float, default=1.0, help="seconds between scrapes the bound is given for")
    parser.add_argument("--out", default="out/scrape_cost")
    parser.add_argument("--name", default="scrape_cost")
    args = parser.parse_args(argv)
    from quasar_hf.commands.serve import servable_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = tiny_checkpoints(out)[1] if args.tiny else servable_checkpoint(args.model)
    port = free_port()
    command = [sys.executable, "-m", "quasar_hf.cli", "serve", str(checkpoint), "--port", str(port)]
    with ServerProcess(command, port, out / f"{args.name}_server.log", timeout_s=900) as server:
        prompts = natural_prompts(60)
        for _ in range(args.requests):
            outcome = ask(port, str(checkpoint), next(prompts), 16, {}, Budget(300, time.monotonic() + 300))
            if outcome.error is not None:
                raise RuntimeError(f"a warm-up request failed: {outcome.error}")
        result = measure(port, server.process.pid, args)
    settings = {k: getattr(args, k) for k in ("scrapes", "requests", "idle_s", "every")}
    report = {
        "command": "python -m benchmarks scrape-cost " + " ".join(sys.argv[1:] if argv is None else argv),
        "checkpoint": str(checkpoint),
        "settings": settings,
        "result": result,
        "environment": environment(),
    }
    return write_json_and_markdown(report, args.out, args.name, to_markdown)


if __name__ == "__main__":
    main()
