"""`compiled-shapes --mixed`: compiled `quasar=True` over a shuffled sequence of batch sizes and prompt lengths,
after one warm-up, beside eager `quasar=True` and llama.cpp's server on the same prompts.

    python -m benchmarks compiled-shapes --mixed --quantized SMOL --llama-server BIN --gguf SMOL_GGUF --name NAME

Steps, each measured in this run:
  1. warm-up, each in a fresh process: cold (empty Inductor cache, no bundle), a second start (the
     bundle and Inductor cache the first left), and from the bundle alone (empty Inductor cache):
     `quasar_hf.warm_up(model, batch_sizes=1..4)`;
  2. in this process, warm-up from the caches the restart used (the steps' traced code loaded), then the sequence (--calls calls: batch 1-4, prompt
     lengths 5-2000 tokens, shuffled with --seed), each call run by every variant back to back (VARIANTS:
     compiled `quasar=True` twice, the first against its repeat; compiled plain decoding, equal tokens
     per row; eager `quasar=True` and eager plain, tokens/s against compiled), so a machine that slows
     down during the run slows all variants alike; Dynamo's graph count before and after (0 new graphs
     is the target);
  3. with --llama-server, each of its n-gram modes on the same prompt ids (a call's rows sent together).
The compiled decode step's time is reported against its bytes floor (int8 weights + lm_head bytes
over the read bandwidth measured here).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from quasar_hf.speculative.left_padding import left_padded

WARM_UP = r"""
import json, sys, torch
import quasar_hf
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
report = quasar_hf.warm_up(model, batch_sizes=[1, 2, 3, 4], max_length=int(sys.argv[2]), progress=False)
print("WARMUP " + json.dumps({"seconds": round(report.seconds, 1), "cache": report.cache, "graphs": report.graphs_compiled}))
"""


def warm_up_in_fresh_processes(checkpoint: str, max_length: int, bundles: str, kept: str) -> dict:
    """Warm-up seconds, each in a fresh process: cold (empty Inductor cache, no bundle); restart (the bundle
    and the Inductor cache the cold run left: a second start on this machine); from_cache (the bundle with an
    empty Inductor cache: after the temporary folder was cleaned). `bundles` and `kept` are left as the
    restart found them, for this process's own warm-up."""
    results = {}
    with tempfile.TemporaryDirectory() as empty:
        for label, inductor in (("cold", kept), ("restart", kept), ("from_cache", empty)):
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor, "QUASAR_HF_CACHE": bundles}
            out = subprocess.run(
                [sys.executable, "-c", WARM_UP, checkpoint, str(max_length)],
                capture_output=True,
                text=True,
                env=env,
                timeout=3600,
            )
            line = next((x for x in out.stdout.splitlines() if x.startswith("WARMUP ")), None)
            results[label] = json.loads(line[7:]) if line else {"error": out.stderr[-500:]}
            print(f"warm-up {label}: {results[label]}", flush=True)
    return results


def sequence(tokenizer, calls: int, seed: int, max_prompt: int = 2000) -> list[list[list[int]]]:
    """`calls` batches of 1-4 prompts of 5-`max_prompt` tokens (token windows of the shipped grounded and
    chat prompts, repeated to length), shuffled with `seed`."""
    from quasar_hf.bench.suites import load_suites, render_prompt

    pool = [render_prompt(item, tokenizer) for item in load_suites("grounded,chat,code")]
    rng = random.Random(seed)
    lengths = [5, 17, 40, 90, 160, 300, 520, 800, 1200, 2000]
    batches = []
    for index in range(calls):
        size, length = (
            1 + index % 4,
            lengths[index % len(lengths)] if max_prompt >= 2000 else min(lengths[index % len(lengths)], max_prompt),
        )
        rows = []
        for _ in range(size):
            source = rng.choice(pool)
            start = rng.randrange(len(source))
            text = (source[start:] + source) * (length // len(source) + 2)
            rows.append(text[:length])
        batches.append(rows)
    rng.shuffle(batches)
    return batches


VARIANTS = {  # name: (quasar option, timed twice); run in this order for each call
    "compiled": ({"compile": True}, True),
    "compiled_plain": ({"compile": True, "num_draft_tokens": 0}, False),
    "eager": (True, False),
    "eager_plain": ({"num_draft_tokens": 0}, False),
}


def run_call(model, batch: list[list[int]], new_tokens: int, quasar, pad: int, repeat: bool) -> dict:
    """One call (again with `repeat`): seconds, of which the prompt's prefill (the same eager code in every
    variant), new tokens, the output rows."""
    ids, mask = left_padded(batch, pad)
    record = {"batch": len(batch), "prompt_tokens": [len(r) for r in batch]}
    for label in ("first", "repeat") if repeat else ("first",):
        started = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=None,
            quasar=quasar,
            return_dict_in_generate=True,
        )
        record[f"{label}_s"] = round(time.perf_counter() - started, 3)
        record.setdefault("prefill_s", round(out.quasar_stats.prefill_time_s, 3))
    record["outputs"] = out.sequences[:, ids.shape[1] :].tolist()
    record["tokens"] = len(batch) * new_tokens
    return record


def run_interleaved(model, batches, new_tokens: int, pad: int) -> dict[str, list[dict]]:
    """Every variant of each call back to back, call after call: a machine that slows down during the run
    slows every variant alike (run one variant after the other, a drift lands on one variant's figures)."""
    rows = {name: [] for name in VARIANTS}
    for batch in batches:
        for name, (quasar, repeat) in VARIANTS.items():
            rows[name].append(run_call(model, batch, new_tokens, quasar, pad, repeat))
        print({name: {k: v for k, v in r[-1].items() if k.endswith("_s")} for name, r in rows.items()}, flush=True)
    return rows


def llamacpp_sequence(binary: str, gguf: str, batches, new_tokens: int, modes: list[str]) -> dict:
    """Each mode of llama-server on the same prompt ids; a call's rows are sent together (one slot each).
    Its logs go to a temporary folder (named in the output), not beside the reports."""
    import threading

    from benchmarks.serve.serve_clients import Prompt, ServerProcess, Wire, free_port, request_once

    results = {}
    log_dir = tempfile.mkdtemp(prefix="compiled-mixed-llama-")
    print(f"llama-server logs: {log_dir}", flush=True)
    for mode in modes:
        port = free_port()
        command = [binary, "-m", gguf, "--port", str(port), "-t", str(torch.get_num_threads()), "-np", "4", "-c", "16384"]
        command += ["--no-warmup"] + (["--spec-type", mode] if mode != "plain" else [])
        seconds, tokens, failed = 0.0, 0, 0
        with ServerProcess(command, port, Path(log_dir) / f"llama-{mode}.log"):
            for batch in batches:
                threads, outcomes = [], []

                def send(row: list[int]) -> None:
                    import http.client

                    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                    wire = Wire("llamacpp", extra={"ignore_eos": True})  # exactly new_tokens, as ours
                    outcomes.append(request_once(connection, wire, Prompt("p", row), new_tokens))
                    connection.close()

                started = time.perf_counter()
                for row in batch:
                    threads.append(threading.Thread(target=send, args=(row,)))
                    threads[-1].start()
                for thread in threads:
                    thread.join()
                seconds += time.perf_counter() - started
                tokens += sum(o.tokens for o in outcomes)
                failed += sum(o.error is not None for o in outcomes)
        results[mode] = {
            "seconds": round(seconds, 2),
            "tokens": tokens,
            "failed": failed,
            "tokens_per_s": round(tokens / seconds, 2),
        }
        print(f"llama-server {mode}: {results[mode]}", flush=True)
    return results


def mixed_main(args) -> dict:
    """The whole --mixed run (see the module docstring); returns the report."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quasar_hf
    from benchmarks.kernels.kernels import measure_read_bandwidth
    from quasar_hf.nn.weight_bytes import step_read_bytes

    bundles, kept = tempfile.mkdtemp(), tempfile.mkdtemp()
    report = {"checkpoint": args.quantized, "warm_up": warm_up_in_fresh_processes(args.quantized, args.max_length, bundles, kept)}
    tokenizer = AutoTokenizer.from_pretrained(args.quantized)
    model = AutoModelForCausalLM.from_pretrained(args.quantized)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = sequence(tokenizer, args.mixed_calls, args.seed, max_prompt=min(2000, args.max_length - args.new_tokens))
    os.environ.update({"TORCHINDUCTOR_CACHE_DIR": kept, "QUASAR_HF_CACHE": bundles})  # the steps the restart loaded
    warm = quasar_hf.warm_up(model, batch_sizes=[1, 2, 3, 4], max_length=args.max_length, progress=False)
    report["warm_up"]["this_process"] = {"seconds": round(warm.seconds, 1), "cache": warm.cache, "graphs": warm.graphs_compiled}
    before = int(counters["stats"]["unique_graphs"])
    runs = run_interleaved(model, batches, args.new_tokens, pad)
    report["interleaved"] = True
    report["graphs_after_warm_up"] = int(counters["stats"]["unique_graphs"]) - before  # eager calls trace nothing
    compiled, plain, eager, eager_plain = (runs[name] for name in VARIANTS)
    for row, other in zip(compiled, plain):
        row["equal_to_compiled_plain"] = row.pop("outputs") == other.pop("outputs")
    for row, other in zip(eager, eager_plain):
        row["equal_to_eager_plain"] = row.pop("outputs") == other.pop("outputs")
    tokens = sum(r["tokens"] for r in compiled)
    report["calls"] = [
        {**c, "eager_s": e["first_s"], "plain_s": p["first_s"], "eager_plain_s": ep["first_s"], "eager_prefill_s": e["prefill_s"]}
        for c, e, p, ep in zip(compiled, eager, plain, eager_plain)
    ]
    report["phases"] = {
        name: {"prefill_s": round(sum(r["prefill_s"] for r in rows), 2), "total_s": round(sum(r["first_s"] for r in rows), 2)}
        for name, rows in (("compiled", compiled), ("compiled_plain", plain), ("eager", eager), ("eager_plain", eager_plain))
    }
    report["summary"] = {
        "calls": len(compiled),
        "graphs_after_warm_up": report["graphs_after_warm_up"],
        "worst_first_over_repeat": round(max(r["first_s"] / r["repeat_s"] for r in compiled), 3),
        "compiled_tokens_per_s": round(tokens / sum(r["first_s"] for r in compiled), 2),
        "compiled_plain_tokens_per_s": round(tokens / sum(r["first_s"] for r in plain), 2),
        "eager_tokens_per_s": round(tokens / sum(r["first_s"] for r in eager), 2),
        "eager_plain_tokens_per_s": round(tokens / sum(r["first_s"] for r in eager_plain), 2),
        "all_equal": all(r["equal_to_compiled_plain"] for r in compiled),
        "eager_all_equal": all(r["equal_to_eager_plain"] for r in eager),
        "drafter": quasar_hf.QuasarGenerationConfig().drafter,
    }
    decode = {name: phase["total_s"] - phase["prefill_s"] for name, phase in report["phases"].items()}
    report["summary"]["compiled_over_eager_decode"] = round(decode["eager"] / decode["compiled"], 3)
    gbps = measure_read_bandwidth(torch.device("cpu"))
    report["floor"] = {
        "bytes": step_read_bytes(model),
        "read_gbps": round(gbps, 2),
        "ms": round(step_read_bytes(model) / gbps / 1e6, 3),
    }
    report["decode_step_ms"] = round(decode_step_ms(model), 3)
    if args.llama_server and args.gguf:
        report["llamacpp"] = llamacpp_sequence(args.llama_server, args.gguf, batches, args.new_tokens, args.llama_modes)
    for folder in (bundles, kept):
        shutil.rmtree(folder, ignore_errors=True)
    return report


def decode_step_ms(model, steps: int = 30) -> float:
    """One compiled [1, 1] decode step over a warm 4096-slot cache: the median of `steps` calls."""
    from quasar_hf import compat
    from quasar_hf.speculative.compiled_steps import compiled_cache_slots, compiled_steps_for, model_context
    from quasar_hf.speculative.static_cache import StaticVerifierCache
    from quasar_hf.speculative.verify_attention import verification_attention

    config = compat.default_compile_config(torch.device("cpu"))
    slots = compiled_cache_slots(1, model_context(model))
    times = []
    with torch.no_grad(), verification_attention(model, True) as kwargs:
        cache = StaticVerifierCache(
            model, 1, torch.device("cpu"), slots, compiled_steps_for(model, config).step_for(1, slots), kwargs
        )
        cache.forward(torch.ones(1, 64, dtype=torch.long), last_only=True)
        for _ in range(steps):
            started = time.perf_counter()
            cache.forward(torch.ones(1, 1, dtype=torch.long))
            times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[len(times) // 2]


def mixed_markdown(report: dict, command: str) -> str:
    s, w = report["summary"], report["warm_up"]
    lines = [
        "# Compiled steps over a shuffled sequence of batch sizes and prompt lengths, after one warm-up",
        "",
        f"`{command}`",
        "",
        f"Checkpoint `{report['checkpoint']}`. Warm-up (batch sizes 1-4, up to 4096 tokens): cold {w['cold'].get('seconds')} s; "
        f"a second start (bundle and Inductor cache) {w['restart'].get('seconds')} s; from the bundle alone (empty Inductor "
        f"cache) {w['from_cache'].get('seconds')} s (each a fresh process); in this process "
        f"{w['this_process']['seconds']} s. Graphs traced after warm-up: {s['graphs_after_warm_up']}. Worst call against its "
        f"repeat: {s['worst_first_over_repeat']}x. Compiled `quasar=True` equals compiled plain on every call: {s['all_equal']}; "
        f"eager `quasar=True` equals eager plain on every call: {s.get('eager_all_equal')}. Drafter: {s.get('drafter', 'ngram')}.",
        "",
        f"Decode step (compiled, 1 row): {report['decode_step_ms']} ms against a {report['floor']['ms']} ms bytes floor "
        f"({report['floor']['bytes'] / 1e6:.1f} MB at {report['floor']['read_gbps']} GB/s), "
        f"{report['decode_step_ms'] / report['floor']['ms']:.2f}x.",
        "",
        "Each call's time splits into its prompt's prefill (the same eager forward in every variant; compiled steps start "
        "after it) and the decode after it (the steps): the decode column is where compiling can pay. "
        + (
            "The variants ran call by call, back to back." if report.get("interleaved") else "The variants ran one after another."
        ),
        "",
        "| variant | tokens/s over the sequence | prefill s | decode s |",
        "|---|---|---|---|",
    ]
    phases = report.get("phases", {})
    for label, key, name in (
        ("compiled `quasar=True`", "compiled_tokens_per_s", "compiled"),
        ("compiled plain", "compiled_plain_tokens_per_s", "compiled_plain"),
        ("eager `quasar=True`", "eager_tokens_per_s", "eager"),
        ("eager plain", "eager_plain_tokens_per_s", "eager_plain"),
    ):
        phase = phases.get(name)
        split = f"{phase['prefill_s']} | {round(phase['total_s'] - phase['prefill_s'], 2)}" if phase else "- | -"
        lines.append(f"| {label} | {s.get(key, '-')} | {split} |")
    for mode, row in (report.get("llamacpp") or {}).items():
        lines.append(f"| llama-server {mode} | {row['tokens_per_s']} | - | - |")
    lines += [
        "",
        "| batch | prompt tokens | compiled first s | repeat s | first / repeat | compiled plain s | eager s | eager plain s | equal |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for r in report["calls"]:
        lines.append(
            f"| {r['batch']} | {max(r['prompt_tokens'])} | {r['first_s']} | {r['repeat_s']} | {r['first_s'] / r['repeat_s']:.2f} | "
            f"{r['plain_s']} | {r['eager_s']} | {r.get('eager_plain_s', '-')} | {'yes' if r['equal_to_compiled_plain'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"
