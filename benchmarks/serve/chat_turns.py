"""Chat-shaped load on `quasar-hf serve` with its prompt cache on and off: a growing conversation, and many clients
behind one long system prompt. Not a test: a bounded load run.

    python -m benchmarks serve-chat --model smollm2 --out DIR [--turns 8] [--words 150] [--clients 8]

Multi-turn: one client, one conversation of --turns turns; each turn adds about --words words of held-out text
and asks for --max-tokens greedy tokens, the history resent every turn (as every OpenAI client does). Per turn:
the prompt's tokens, the time to the first streamed token, and the tokens the server reused from its cache
(`/metrics`). Shared system prompt: --clients clients at once, one --system-words system prompt, each its own
question; the mean and largest time to first token. Each shape runs on a server with the cache and on one
started with `--prompt-cache-gb 0`, one server at a time.
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

import torch

from benchmarks.serve.serve_clients import ServerProcess, free_port, from_clients
from quasar_hf.bench.report import write_json_and_markdown


def held_out_words(count: int) -> list[str]:
    from quasar_hf.smoothquant.builtin_text import mix_texts

    words = " ".join(mix_texts("heldout")).split()
    return (words * (1 + count // max(len(words), 1)))[:count]


def first_token_seconds(port: int, model: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """Send one streamed greedy chat request: seconds to its first content, and its whole text."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started, first, text = time.perf_counter(), None, ""
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        piece = ((json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}).get("content") or ""
        if piece and first is None:
            first = time.perf_counter() - started
        text += piece
    connection.close()
    return (first if first is not None else time.perf_counter() - started), text


def reused_tokens(base: str) -> float:
    """Our server's prompt-cache counter (0 for a server without it, such as llama-server)."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
            lines = response.read().decode().splitlines()
    except OSError:
        return 0.0
    for line in lines:
        if line.startswith("quasar_prompt_cache_tokens_reused_total "):
            return float(line.split()[1])
    return 0.0


def multi_turn(server: ServerProcess, model: str, tokenizer, args) -> list[dict]:
    words = held_out_words(args.turns * args.words)
    messages: list[dict] = []
    turns = []
    for turn in range(args.turns):
        chunk = " ".join(words[turn * args.words : (turn + 1) * args.words])
        messages.append({"role": "user", "content": f"Summarize this in one sentence: {chunk}"})
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        prompt_tokens = len(rendered["input_ids"])
        before = reused_tokens(server.base)
        ttft, text = first_token_seconds(server.port, model, messages, args.max_tokens)
        turns.append(
            {
                "turn": turn + 1,
                "prompt_tokens": prompt_tokens,
                "ttft_s": round(ttft, 3),
                "reused": reused_tokens(server.base) - before,
            }
        )
        messages.append({"role": "assistant", "content": text})
    return turns


def shared_system_prompt(server: ServerProcess, model: str, args) -> list[dict]:
    """--waves waves of --clients requests sent at once, each with the system prompt and a question of its own."""
    system = " ".join(held_out_words(args.system_words))
    waves = []
    for wave in range(args.waves):
        questions = [f"Question {wave}.{i}: what is the main point of part {i + 1}?" for i in range(args.clients)]
        ttfts: list[float] = [0.0] * args.clients
        before = reused_tokens(server.base)

        def ask(index: int) -> None:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": questions[index]}]
            ttfts[index] = first_token_seconds(server.port, model, messages, 32)[0]

        wall = from_clients(args.clients, args.clients, ask)
        waves.append(
            {
                "wave": wave + 1,
                "ttft_mean_s": round(statistics.mean(ttfts), 3),
                "ttft_max_s": round(max(ttfts), 3),
                "wall_s": round(wall, 2),
                "reused": reused_tokens(server.base) - before,
            }
        )
    return waves


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks serve-chat", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="what `quasar-hf serve` takes (default: the embedded SmolLM2)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--words", type=int, default=150)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=700, help="about 1,000 tokens for SmolLM2's tokenizer")
    parser.add_argument("--waves", type=int, default=3, help="waves of --clients requests behind the system prompt")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary: run the same load on it (cache_prompt on)")
    parser.add_argument("--gguf", help="the GGUF llama-server serves (the same model)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--name", default="serve_chat")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from quasar_hf.commands.serve import servable_checkpoint

    checkpoint = servable_checkpoint(args.model)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    ours = [sys.executable, "-m", "quasar_hf.cli", "serve", checkpoint, "--port"]
    servers = {"cache": (ours, []), "no_cache": (ours, ["--prompt-cache-gb", "0"])}
    if args.llama_server and args.gguf:  # its slots keep their KV and reuse the longest shared prefix (cache_prompt)
        threads = str(torch.get_num_threads())
        servers["llama_server"] = ([args.llama_server, "-m", args.gguf, "-t", threads, "-np", "8", "-c", "32768", "--port"], [])
    for label, (command, flags) in servers.items():
        port = free_port()
        with ServerProcess([*command, str(port), *flags], port, out / f"{args.name}_{label}.log", timeout_s=900) as server:
            runs[label] = {"multi_turn": multi_turn(server, checkpoint, tokenizer, args)}
            runs[label]["shared_system_prompt"] = shared_system_prompt(server, checkpoint, args)
    result = {
        "command": "python -m benchmarks serve-chat " + " ".join(argv if argv is not None else sys.argv[1:]),
        "checkpoint": checkpoint,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "name")},
        "runs": runs,
    }
    return write_json_and_markdown(result, out, args.name, to_markdown)


def to_markdown(result: dict) -> str:
    cache, plain = result["runs"]["cache"], result["runs"]["no_cache"]
    llama = result["runs"].get("llama_server")
    lines = [
        "# Chat-shaped load: quasar-hf serve with its prompt cache and without",
        "",
        f"`{result['command']}`",
        "",
        "Multi-turn (one client, history resent every turn): time to first token, seconds",
        "",
        "| turn | prompt tokens | with the cache | reused tokens | without | llama-server |",
        "|---|---|---|---|---|---|",
    ]
    peer = llama["multi_turn"] if llama else [None] * len(cache["multi_turn"])
    for on, off, other in zip(cache["multi_turn"], plain["multi_turn"], peer):
        theirs = other["ttft_s"] if other else "not run"
        lines.append(f"| {on['turn']} | {on['prompt_tokens']} | {on['ttft_s']} | {on['reused']:g} | {off['ttft_s']} | {theirs} |")
    first, last = cache["multi_turn"][0]["ttft_s"], cache["multi_turn"][-1]["ttft_s"]
    lines += ["", f"Last turn over first, with the cache: {last / first:.2f}x.", ""]
    lines += [
        f"Shared system prompt ({result['settings']['clients']} clients at once, wave after wave): time to first token",
        "",
        "| server | wave | mean s | largest s | wall s | reused tokens |",
        "|---|---|---|---|---|---|",
    ]
    for label, run in (("with the cache", cache), ("without", plain), ("llama-server", llama)):
        for wave in (run or {}).get("shared_system_prompt", []):
            row = f"| {label} | {wave['wave']} | {wave['ttft_mean_s']} | {wave['ttft_max_s']} | {wave['wall_s']} | {wave['reused']:g} |"
            lines.append(row)
    lines += ["", f"Environment: {result.get('environment')}"]
    return "\n".join(lines) + "\n"
