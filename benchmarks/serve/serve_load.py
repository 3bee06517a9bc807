"""Served side by side under load: `quasar-hf serve` with Quasar on and off, the BF16 model under
`transformers serve`, and llama.cpp's `llama-server` on a Q8_0 GGUF of the same model, plain and with
each of its n-gram speculation modes. Not a test: a bounded load run.

    python -m benchmarks serve-load --out DIR --llama-server BIN --gguf smollm2=FILE,qwen2.5-coder=FILE
    python -m benchmarks serve-load --tiny --out DIR          # mechanics: a tiny checkpoint, our server only

Per model and server, for 1, 2, 4 and 8 concurrent clients: --requests greedy requests of --max-tokens
tokens (the shipped chat, code and grounded prompts, in turn), each client sending its next request
when its last one ends. Per level: failed requests, our responses equal to offline decoding of the
same checkpoint (the same mode: eager, or compiled for quasar-compiled), time to first token, latency
p50/p95, aggregate tokens/s; per server: peak RSS and RSS over the run. A response that differs from
offline is traced to its first differing token, where the offline logits' gap between the two
leading tokens must be a near-tie (<= --near-tie nats). One server runs at a time. With --rounds N each
server runs its rows and levels N times, rows interleaved, and the report gives Quasar on over off round by
round: on a host whose speed drifts, one round of each is not a comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.serve.serve_clients import MetricsScraper, Prompt, ServerProcess, Wire, free_port, rss_bytes, run_level
from quasar_hf.bench.report import environment, write_json_and_markdown
from quasar_hf.bench.suites import load_suites, render_prompt

LLAMA_SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
OURS = ("quasar", "quasar-compiled")  # our server, eager and with --compile: each answers Quasar and Quasar-off rows


def interleaved_prompts(tokenizer, count: int) -> list[Prompt]:
    """`count` prompts taking the chat, code and grounded suites in turn."""
    suites = [load_suites(name) for name in ("chat", "code", "grounded")]
    items = [suite[i % len(suite)] for i in range(count) for suite in suites][:count]
    return [Prompt(item["id"], render_prompt(item, tokenizer), item.get("messages"), item.get("prompt")) for item in items]


def offline_reference(model, tokenizer, prompts: list[Prompt], max_tokens: int, compiled: bool) -> list[list[int]]:
    """Greedy plain decoding of each prompt in this process (compiled like the server with --compile)."""
    quasar = {"compile": True, "num_draft_tokens": 0} if compiled else False
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt.ids])
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, quasar=quasar)
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def near_tie_gap(model, tokenizer, prompt: Prompt, offline: list[int], served_text: str) -> dict:
    """Where a served text leaves offline decoding: the token index and the offline logits' top-2 gap there."""
    index = next(
        (
            k
            for k in range(1, len(offline) + 1)
            if not served_text.startswith(tokenizer.decode(offline[:k], skip_special_tokens=True))
        ),
        None,
    )
    if index is None:
        return {"token": None, "gap_nats": None, "note": "the served text is a prefix of offline's (stopped early)"}
    ids = torch.tensor([prompt.ids + offline[: index - 1]])
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float().log_softmax(-1)
    top = logits.topk(2)
    return {"token": index - 1, "gap_nats": round(float(top.values[0] - top.values[1]), 4)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(level: dict, offline_texts: list[str] | None, prompts: list[Prompt]) -> dict:
    outcomes = level["outcomes"]
    done = [o for o in outcomes if o is not None and o.error is None]
    equal = None
    if offline_texts is not None:
        equal = sum(o.text == offline_texts[[p.id for p in prompts].index(o.prompt)] for o in done)
    tokens = sum(o.tokens for o in done)
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(done),
        "errors": sorted({o.error for o in outcomes if o is not None and o.error})[:3],
        "equal_to_offline": equal,
        "tokens": tokens,
        "tokens_per_s": round(tokens / level["wall_s"], 2),
        "ttft_p50_s": _round(percentile([o.first_token - o.started for o in done if o.first_token], 0.5)),
        "latency_p50_s": _round(percentile([o.ended - o.started for o in done], 0.5)),
        "latency_p95_s": _round(percentile([o.ended - o.started for o in done], 0.95)),
        "texts": {o.prompt: o.text for o in done},
        "rss": [o.rss for o in outcomes if o is not None],
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def server_commands(args, name: str, checkpoint: str, base: str, gguf: str | None, port: int) -> list[str] | None:
    """The command line of server `name` on `port` (None: not available here)."""
    if name in OURS:
        extra = ["--compile", "--max-model-len", str(args.max_model_len)] if name == "quasar-compiled" else []
        return [
            sys.executable,
            "-m",
            "quasar_hf.cli",
            "serve",
            checkpoint,
            "--port",
            str(port),
            "--max-batch-size",
            str(max(args.levels)),
            "--prompt-cache-gb",
            "0",  # no reuse of earlier requests' keys and values: llama-server runs with cache_prompt false here
            *extra,
        ]
    if name == "bf16":
        call = "import sys; from transformers.cli.transformers import main; sys.argv = ['transformers', *sys.argv[1:]]; main()"
        return [sys.executable, "-c", call, "serve", base, "--device", "cpu", "--dtype", "bfloat16", "--port", str(port)]
    if name.startswith("llamacpp") and args.llama_server and gguf:
        slots = max(args.levels)
        command = [args.llama_server, "-m", gguf, "--port", str(port), "-t", str(torch.get_num_threads()), "-np", str(slots)]
        command += ["-c", str(slots * args.max_model_len), "--no-warmup"]
        spec = name.removeprefix("llamacpp").removeprefix("-")
        return command + (["--spec-type", spec] if spec else [])
    return None


def measure_server(args, label: str, command: list[str], wires: dict[str, Wire], prompts, offline_texts, log_dir: Path) -> dict:
    """Each row of `wires` (a request kind) on one server process at every level, `args.rounds` times with the rows
    interleaved (so that a drifting host moves every row alike); `offline_texts`: what our rows must equal (None for
    the other servers). A level's figures pool its rounds; `tokens_per_s_by_round` keeps each round's."""
    port = int(command[command.index("--port") + 1])
    pooled = {
        row: {str(c): {"outcomes": [], "wall_s": 0.0, "by_round": [], "scrapes": 0, "failed_scrapes": 0} for c in args.levels}
        for row in wires
    }
    results = {}
    with ServerProcess(command, port, log_dir / f"{label}.log", "/health") as server:
        for wire in wires.values():
            run_level(server.base, wire, prompts, 1, 1, 8, server.process.pid)  # one untimed request
        for round_index in range(args.rounds):
            for row, wire in wires.items():
                for clients in args.levels:
                    scraping = row.endswith("_scraped")
                    with MetricsScraper(server.base, args.scrape_metrics) if scraping else contextlib.nullcontext() as scraper:
                        level = run_level(server.base, wire, prompts, clients, args.requests, args.max_tokens, server.process.pid)
                    into = pooled[row][str(clients)]
                    into["outcomes"] += level["outcomes"]
                    into["wall_s"] += level["wall_s"]
                    into["by_round"].append(summarize(level, None, prompts)["tokens_per_s"])
                    if scraping:
                        into["scrapes"] += scraper.scrapes
                        into["failed_scrapes"] += scraper.failures
                    print(f"  round {round_index + 1} {row} x{clients}: {into['by_round'][-1]} tokens/s", flush=True)
        for row in wires:
            levels = {}
            for clients, into in pooled[row].items():
                levels[clients] = {**summarize(into, offline_texts, prompts), "tokens_per_s_by_round": into["by_round"]}
                if row.endswith("_scraped"):
                    levels[clients].update(scrapes=into["scrapes"], failed_scrapes=into["failed_scrapes"])
            results[row] = {"levels": levels, "start_s": round(server.ready_s, 1)}
        peak = rss_bytes(server.process.pid, "VmHWM")
    for row in results.values():
        row["peak_rss_mb"] = None if peak is None else round(peak / 2**20)
        rss = [r for level in row["levels"].values() for r in level.pop("rss") if r]
        first, last = rss[:100], rss[-100:]
        row["rss_last_vs_first_100"] = round(statistics.mean(last) / statistics.mean(first), 4) if first else None
    return results


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks serve-load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,qwen2.5-coder", help="embedded model aliases")
    parser.add_argument(
        "--servers", default="quasar,quasar-compiled,bf16,llamacpp," + ",".join(f"llamacpp-{t}" for t in LLAMA_SPEC_TYPES)
    )
    parser.add_argument("--levels", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests", type=int, default=32, help="requests per level")
    parser.add_argument("--rounds", type=int, default=1, help="each server's rows and levels this many times, interleaved")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (../shared/tools/build_llamacpp.sh)")
    parser.add_argument("--gguf", default="", help="model=Q8_0 GGUF file, comma-separated")
    parser.add_argument("--near-tie", type=float, default=1.0, help="largest logit gap (nats) a differing response may have")
    parser.add_argument("--tiny", action="store_true", help="mechanics only: a tiny random checkpoint, our server")
    parser.add_argument(
        "--scrape-metrics",
        type=float,
        default=0.0,
        help="seconds between /metrics scrapes: our servers run a third row, Quasar on while scraped (0: none)",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="serve_load")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ggufs = dict(item.split("=", 1) for item in args.gguf.split(",") if item)
    result = {"environment": environment(), "command": "python -m benchmarks serve-load " + " ".join(argv or sys.argv[1:])}
    result.update(settings={k: v for k, v in vars(args).items() if k not in ("out",)}, models={})
    for alias in ["tiny"] if args.tiny else args.models.split(","):
        result["models"][alias] = measure_model(args, alias, ggufs.get(alias), out)
        write_json_and_markdown(result, out, args.name, to_markdown)
    return [str(out / f"{args.name}.json"), str(out / f"{args.name}.md")]


def measure_model(args, alias: str, gguf: str | None, out: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quasar_hf.commands.loading import resolve_model
    from quasar_hf.commands.serve import servable_checkpoint

    base, checkpoint = tiny_checkpoints(out) if alias == "tiny" else (resolve_model(alias), None)
    checkpoint = checkpoint or servable_checkpoint(base)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    prompts = interleaved_prompts(tokenizer, args.requests)
    report = {"checkpoint": checkpoint, "servers": {}}
    off = json.loads((Path(checkpoint) / "generation_config.json").read_text())
    references = {}
    for name in [s for s in args.servers.split(",") if s]:
        command = server_commands(args, name, checkpoint, base, gguf, free_port())
        if command is None:
            report["servers"][name] = {"skipped": "not available here (llama-server binary or GGUF missing)"}
            continue
        offline = None
        if name in OURS:
            if name not in references:  # offline decoding in the server's mode, before the server starts
                started = time.perf_counter()
                tokens = offline_reference(model, tokenizer, prompts, args.max_tokens, name == "quasar-compiled")
                references[name] = (tokens, [tokenizer.decode(ids, skip_special_tokens=True) for ids in tokens])
                report[f"offline_{name}_s"] = round(time.perf_counter() - started, 1)
            offline = references[name][1]
            quasar_off = {"generation_config": json.dumps({**off, "quasar": False})}
            rows = {name: Wire("openai", checkpoint), f"{name}_off": Wire("openai", checkpoint, quasar_off)}
            if args.scrape_metrics:
                rows[f"{name}_scraped"] = Wire("openai", checkpoint)
        else:
            rows = {name: Wire("llamacpp") if name.startswith("llamacpp") else Wire("openai", base)}
        print(f"{alias}: {name}", flush=True)
        try:
            report["servers"].update(measure_server(args, f"{alias}-{name}", command, rows, prompts, offline, out))
        except RuntimeError as error:
            report["servers"][name] = {"skipped": str(error)[:500]}
    for name, (tokens, texts) in references.items():
        for row in (name, f"{name}_off", f"{name}_scraped"):
            for level in report["servers"].get(row, {}).get("levels", {}).values():
                served = level.pop("texts")
                level["divergences"] = [
                    {"prompt": p.id, **near_tie_gap(model, tokenizer, p, o, served[p.id])}
                    for p, o, t in zip(prompts, tokens, texts)
                    if p.id in served and served[p.id] != t
                ]
                level["all_near_ties"] = all((d["gap_nats"] or 0) <= args.near_tie for d in level["divergences"])
    for data in report["servers"].values():
        for level in data.get("levels", {}).values():
            level.pop("texts", None)
    return report


def tiny_checkpoints(out: Path) -> tuple[str, str]:
    """A tiny float checkpoint and its Quasar quantization, both in `out` (nothing in the user's cache)."""
    from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny

    base, quantized = out / "tiny-base", out / "tiny-quasar"
    if not (base / "config.json").is_file():
        make_tiny_checkpoint(base)
    if not (quantized / "config.json").is_file():
        from transformers import AutoTokenizer

        quantize_tiny(str(base)).save_pretrained(quantized)
        AutoTokenizer.from_pretrained(base).save_pretrained(quantized)
    return str(base), str(quantized)


def to_markdown(result: dict) -> str:
    lines = ["# Served under load: quasar-hf serve, transformers serve, llama-server", "", f"`{result['command']}`", ""]
    for alias, model in result["models"].items():
        lines += [
            f"## {alias}",
            "",
            "| server | clients | tokens/s | TTFT p50 s | latency p50 s | p95 s | failed | equal to offline | peak RSS MB |",
        ]
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for name, data in model["servers"].items():
            if "skipped" in data:
                lines.append(f"| {name} | - | skipped: {data['skipped'][:80]} | | | | | | |")
                continue
            for clients, level in data["levels"].items():
                equal = (
                    "-"
                    if level["equal_to_offline"] is None
                    else f"{level['equal_to_offline']}/{level['requests'] - level['failed']}"
                )
                label = f"{name} ({level['scrapes']} scrapes, {level['failed_scrapes']} failed)" if "scrapes" in level else name
                row = [label, clients, level["tokens_per_s"], level["ttft_p50_s"], level["latency_p50_s"], level["latency_p95_s"]]
                lines.append("| " + " | ".join(map(str, [*row, level["failed"], equal, data["peak_rss_mb"]])) + " |")
        lines += ["", *scrape_costs(model["servers"]), *on_off_rounds(model["servers"]), ""]
    lines.append(f"Environment: {result.get('environment')}")
    return "\n".join(lines) + "\n"


def scrape_costs(servers: dict) -> list[str]:
    """One line per level of a scraped row: its tokens/s against the same server's unscraped Quasar row."""
    lines = []
    for name, data in servers.items():
        plain = servers.get(name.removesuffix("_scraped"), {}).get("levels", {})
        for clients, level in data.get("levels", {}).items() if name.endswith("_scraped") else ():
            if plain.get(clients, {}).get("tokens_per_s"):
                ratio = level["tokens_per_s"] / plain[clients]["tokens_per_s"]
                lines.append(f"- {name} at {clients} clients: {ratio:.3f}x the unscraped tokens/s ({level['scrapes']} scrapes)")
    return lines


def on_off_rounds(servers: dict) -> list[str]:
    """Where a server ran several rounds: Quasar on over off, round by round (the rounds ran interleaved)."""
    lines = []
    for name, data in servers.items():
        off = servers.get(f"{name}_off", {}).get("levels", {})
        for clients, level in data.get("levels", {}).items():
            on_rounds, off_rounds = level.get("tokens_per_s_by_round", []), off.get(clients, {}).get("tokens_per_s_by_round", [])
            if len(on_rounds) > 1 and len(off_rounds) == len(on_rounds) and all(off_rounds):
                ratios = [a / b for a, b in zip(on_rounds, off_rounds)]
                lines.append(
                    f"- {name} over {name}_off at {clients} clients, round by round: "
                    + ", ".join(f"{r:.3f}" for r in ratios)
                    + f" (median {statistics.median(ratios):.3f})"
                )
    return lines


if __name__ == "__main__":
    main()
