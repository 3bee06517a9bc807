"""Eager vs compiled decode and verify steps of a saved Quasar checkpoint, against the bytes floor;
then end to end: plain greedy and `quasar=True`, eager and compiled, with exactness beside speed.

Steps: one forward of 1 token (decode) and of 6 (a 5-draft verification) over a 300-token cache,
for three verifiers of the same weights: the dynamic cache the loop uses by default
(RowAlignedCache), the static cache eager, and the static cache with the step compiled by
`quasar={"compile": True}`'s settings. Modes alternate round by round in one process (the
machine is shared), at all torch threads and at one. The floor is the int8 weights + lm_head
bytes over the read bandwidth measured in the same process. The first compiled call of each
shape is timed apart (compile time; Inductor's on-disk cache makes a second process faster).

With `--gguf FILE` (a Q8_0 GGUF of the same checkpoint; needs llama-cpp-python), llama.cpp's forward of
the same 1 and 6 tokens over its own 300-token cache runs in the same rounds, beside the others, and
its plain greedy decoding of the same prompts end to end.

End to end: `--prompts` grounded prompts, `--new-tokens` each: plain greedy eager (generate),
quasar eager, compiled plain (the loop with num_draft_tokens=0: every step the compiled decode)
and compiled quasar; tokens/s, and whether compiled quasar equals compiled plain token for token.

    python -m benchmarks compiled-steps --quantized DIR --name compiled_steps_smollm2_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, CompileConfig

import quasar_hf  # noqa: F401
from benchmarks import reports_dir
from benchmarks.speed.op_overhead import markdown as op_overhead_markdown
from benchmarks.speed.op_overhead import op_overhead
from quasar_hf import compat
from quasar_hf.bench.report import write_json_and_markdown
from quasar_hf.detect import plain_decoding
from quasar_hf.nn.weight_bytes import step_read_bytes
from quasar_hf.speculative import step_compiler
from quasar_hf.speculative.config import DEFAULT_NUM_DRAFT_TOKENS
from quasar_hf.speculative.row_aligned_cache import RowAlignedCache
from quasar_hf.speculative.static_cache import StaticVerifierCache, static_cache_slots

CACHE_TOKENS = 300
STEP_TOKENS = (1, 6)


def cache_prompt(model) -> torch.Tensor:
    """[1, CACHE_TOKENS] random token ids: what every verifier's cache holds before a timed step."""
    return torch.randint(0, model.config.vocab_size, (1, CACHE_TOKENS), generator=torch.Generator().manual_seed(0))


def verifiers(model, compiled_step, variants: dict | None = None) -> dict:
    """name -> a prefilled verifier over the same CACHE_TOKENS random tokens (`variants`: more compiled
    steps by name, e.g. other graph passes)."""
    prompt = cache_prompt(model)
    slots = static_cache_slots(CACHE_TOKENS + max(STEP_TOKENS) + 1)
    states = {
        "dynamic_eager": RowAlignedCache(model, 1, torch.device("cpu")),
        "static_eager": StaticVerifierCache(model, 1, torch.device("cpu"), slots),
        "static_compiled": StaticVerifierCache(model, 1, torch.device("cpu"), slots, step=compiled_step),
    }
    for name, step in (variants or {}).items():
        states[name] = StaticVerifierCache(model, 1, torch.device("cpu"), slots, step=step)
    for state in states.values():
        state.forward(prompt, last_only=True)
    return states


class LlamaCppSteps:
    """llama.cpp (llama-cpp-python) as a verifier state: `forward` evaluates tokens (all logits) over
    the prompt's cache, `keep_accepted` moves its length back to the prompt's."""

    def __init__(self, gguf: str, threads: int, prompt: list[int]) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=gguf, n_ctx=512, n_batch=512, n_threads=threads, n_threads_batch=threads, logits_all=True, verbose=False
        )
        self.llm.eval(prompt)
        self.prompt_tokens = len(prompt)

    def forward(self, ids: torch.Tensor) -> None:
        self.llm.eval(ids[0].tolist())

    def keep_accepted(self, num_keep: torch.Tensor, num_appended: int) -> None:
        self.llm.n_tokens = self.prompt_tokens


def llamacpp_states(gguf: str, thread_counts: list[int], prompt: list[int]) -> dict:
    """threads -> a LlamaCppSteps over `prompt` (the tokens the verifiers' caches hold)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit("--gguf needs llama-cpp-python (see quasar_hf/bench/llamacpp_peer.py for the install)") from None
    return {count: LlamaCppSteps(gguf, count, prompt) for count in thread_counts}


def run_steps(state, tokens: int, steps: int, vocab: int) -> float:
    """Mean ms of `steps` forwards of `tokens` random tokens below `vocab`, each rolled back to the same cache."""
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    start = time.perf_counter()
    for _ in range(steps):
        state.forward(ids)
        state.keep_accepted(torch.tensor([0]), tokens)
    return (time.perf_counter() - start) / steps * 1e3


def time_steps(
    model, compiled_step, steps: int, rounds: int, floors: dict, variants: dict | None = None, gguf: str | None = None
) -> tuple[dict, dict]:
    """(rows "threads x tokens" -> ms per mode and x its floor, compile seconds per step shape); `floors`:
    "model" (ms) and, with `gguf`, "llamacpp_q8_0" (its file's bytes)."""
    vocab = model.config.vocab_size
    states = verifiers(model, compiled_step, variants)
    compile_s = {}
    for name in ("static_compiled", *(variants or {})):
        for tokens in STEP_TOKENS:
            began = time.perf_counter()
            run_steps(states[name], tokens, 1, vocab)
            key = f"{tokens}_tokens" if name == "static_compiled" else f"{name} {tokens}_tokens"
            compile_s[key] = time.perf_counter() - began
    threads = torch.get_num_threads()
    counts = sorted({threads, 1}, reverse=True)
    llamacpp = llamacpp_states(gguf, counts, cache_prompt(model)[0].tolist()) if gguf else {}
    rows = {}
    for count in counts:
        torch.set_num_threads(count)
        if llamacpp:
            states["llamacpp_q8_0"] = llamacpp[count]
        for tokens in STEP_TOKENS:
            totals = dict.fromkeys(states, 0.0)
            for _ in range(rounds):
                for name, state in states.items():
                    run_steps(state, tokens, 1, vocab)  # warm
                    totals[name] += run_steps(state, tokens, steps, vocab)
            row = {"threads": count, "tokens": tokens}
            for name, total in totals.items():
                row[f"{name}_ms"] = total / rounds
                row[f"{name}_x_floor"] = total / rounds / floors.get(name, floors["model"])
            rows[f"{count}x{tokens}"] = row
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    torch.set_num_threads(threads)
    return rows, compile_s


def guard_check_ms(model, compiled_step, steps: int = 10) -> dict:
    """Per step shape, ms per compiled call that torch.profiler attributes to Dynamo's guard check
    ("TorchDynamo Cache Lookup", self time) over `steps` warm steps of a fresh static-cache verifier."""
    from torch.profiler import ProfilerActivity, profile

    slots = static_cache_slots(CACHE_TOKENS + max(STEP_TOKENS) + 1)
    state = StaticVerifierCache(model, 1, torch.device("cpu"), slots, step=compiled_step)
    state.forward(cache_prompt(model), last_only=True)  # one verifier: the compiled one
    vocab, result = model.config.vocab_size, {}
    for tokens in STEP_TOKENS:
        run_steps(state, tokens, 2, vocab)  # warm (the graphs are compiled already)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run_steps(state, tokens, steps, vocab)
        lookup = [e.self_cpu_time_total for e in prof.key_averages() if e.key == "TorchDynamo Cache Lookup"]
        result[f"{tokens}_tokens"] = sum(lookup) / 1e3 / steps
    return result


def end_to_end(model, tokenizer, prompts: int, new_tokens: int, compile_config, gguf: str | None = None) -> dict:
    """Tokens/s of four ways to decode the same grounded prompts (five with `gguf`: llama.cpp's plain
    greedy decoding of its Q8_0 model, which has its own rounding, so its tokens are not expected to
    equal ours), and compiled exactness."""
    from quasar_hf.bench.suites import load_suite, render_prompt

    items = load_suite("grounded")[:prompts]
    ids_list = [torch.tensor([render_prompt(item, tokenizer)]) for item in items]
    compiled = {"compile": compile_config}
    modes = {
        "plain_eager": None,
        "quasar_eager": True,
        "plain_compiled": {**compiled, "num_draft_tokens": 0},
        "quasar_compiled": compiled,
    }
    # Compile first: one warm run per cache size (prompt + new tokens rounded up to 256 slots: a new
    # size is a new pair of graphs), so no compile time falls in the timed runs.
    warmed = set()
    for ids in ids_list:
        size = static_cache_slots(ids.shape[1] + new_tokens + DEFAULT_NUM_DRAFT_TOKENS + 1)
        if size not in warmed:
            warmed.add(size)
            for name in ("quasar_compiled", "plain_compiled"):
                model.generate(ids, max_new_tokens=new_tokens, do_sample=False, quasar=modes[name])
    llamacpp = {}
    if gguf:
        from quasar_hf.bench.llamacpp_peer import build_llamacpp_variants

        eos = model.generation_config.eos_token_id
        stop_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        llamacpp = build_llamacpp_variants(["llamacpp_q8_0"], gguf, stop_ids)
        llamacpp["llamacpp_q8_0"](ids_list[0], 4)  # load and warm
    names = [*modes, *llamacpp]
    results = {name: {"seconds": 0.0, "new_tokens": 0, "verify_steps": 0, "forward_s": 0.0, "loop_s": 0.0} for name in names}
    outputs = {name: [] for name in names}
    for ids in ids_list:
        for name in names:
            quasar = modes.get(name)
            began = time.perf_counter()
            if name in llamacpp:
                tokens, _ = llamacpp[name](ids, new_tokens)
                out, stats = torch.cat([ids, torch.tensor([tokens], dtype=ids.dtype)], dim=1), None
            elif quasar is None:
                out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, **plain_decoding(model))
                stats = None
            else:
                gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, quasar=quasar, return_dict_in_generate=True)
                out, stats = gen.sequences, gen.quasar_stats
            results[name]["seconds"] += time.perf_counter() - began
            results[name]["new_tokens"] += out.shape[1] - ids.shape[1]
            outputs[name].append(out)
            if stats is not None:
                results[name]["verify_steps"] += stats.verify_steps
                results[name]["forward_s"] += stats.forward_time_s
                results[name]["loop_s"] += stats.loop_time_per_step_s * stats.verifier_forwards
    for row in results.values():
        row["tokens_per_s"] = row["new_tokens"] / row["seconds"]
        if row["verify_steps"]:  # batch 1: one verifier forward per verify step
            row["forward_ms_per_step"] = row["forward_s"] / row["verify_steps"] * 1e3
            row["loop_ms_per_step"] = row["loop_s"] / row["verify_steps"] * 1e3
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(outputs[a], outputs[b]))  # noqa: E731
    exact = {
        "quasar_compiled_equals_plain_compiled": same("quasar_compiled", "plain_compiled"),
        "quasar_eager_equals_plain_eager": same("quasar_eager", "plain_eager"),
        "compiled_equals_eager": same("plain_compiled", "plain_eager"),
    }
    if llamacpp:  # another model (Q8_0 weights, float activations): for information
        exact["llamacpp_q8_0_equals_plain_eager"] = same("llamacpp_q8_0", "plain_eager")
    return {"prompts": len(ids_list), "max_new_tokens": new_tokens, "modes": results, "exact": exact}


def markdown(result: dict) -> str:
    lines = [f"# Eager vs compiled steps: {result['model']} ({result['dtype']})", "", f"Command: `{result['command']}`", ""]
    lines += [
        f"Floor {result['floor_ms']:.2f} ms ({result['floor_bytes'] / 1e6:.1f} MB at {result['read_gbps']:.1f} GB/s read). "
        f"Cache {CACHE_TOKENS} tokens. First compiled call (compile): "
        + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in result["compile_s"].items())
        + _guard_sentence(result),
        "",
        "| threads | tokens | dynamic eager ms | static eager ms | static compiled ms | compiled x floor | eager / compiled |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["steps"].values():
        ratio = row["dynamic_eager_ms"] / row["static_compiled_ms"]
        lines.append(
            f"| {row['threads']} | {row['tokens']} | {row['dynamic_eager_ms']:.2f} | {row['static_eager_ms']:.2f} | "
            f"{row['static_compiled_ms']:.2f} | {row['static_compiled_x_floor']:.2f} | {ratio:.2f} |"
        )
    llama = result.get("llamacpp")
    if llama:
        lines += [
            "",
            f"llama.cpp (llama-cpp-python {llama['version']}) on `{llama['gguf']}` ({llama['gguf_bytes'] / 1e6:.1f} MB, "
            f"floor {llama['floor_ms']:.2f} ms), all logits, same rounds:",
            "",
            "| threads | tokens | llama.cpp ms | llama.cpp x its floor | static compiled ms | llama.cpp / compiled |",
            "|---|---|---|---|---|---|",
        ]
        for row in result["steps"].values():
            lines.append(
                f"| {row['threads']} | {row['tokens']} | {row['llamacpp_q8_0_ms']:.2f} | {row['llamacpp_q8_0_x_floor']:.2f} | "
                f"{row['static_compiled_ms']:.2f} | {row['llamacpp_q8_0_ms'] / row['static_compiled_ms']:.2f} |"
            )
    variants = result.get("variants") or []
    if variants:
        lines += ["", "Compiled with other post-grad passes (same run, interleaved), ms:", ""]
        lines += [
            "| threads | tokens | " + " | ".join(["static_compiled", *variants]) + " |",
            "|---|---|" + "---|" * (len(variants) + 1),
        ]
        for row in result["steps"].values():
            cells = " | ".join(f"{row[f'{name}_ms']:.2f}" for name in ["static_compiled", *variants])
            lines.append(f"| {row['threads']} | {row['tokens']} | {cells} |")
    if result.get("op_overhead"):
        lines += ["", *op_overhead_markdown(result["op_overhead"])]
    e2e = result.get("end_to_end")
    if e2e:
        lines += ["", f"End to end: {e2e['prompts']} grounded prompts x {e2e['max_new_tokens']} new tokens.", ""]
        lines += [
            "| mode | tokens/s | forwards (verify steps + prefill) | forward ms / step | loop ms / step (draft, accept, rollback) |",
            "|---|---|---|---|---|",
        ]
        for name, row in e2e["modes"].items():
            steps = row["verify_steps"] + e2e["prompts"] if row["verify_steps"] else "one per token"
            forward, loop = (f"{row[k]:.2f}" if k in row else "-" for k in ("forward_ms_per_step", "loop_ms_per_step"))
            lines.append(f"| {name} | {row['tokens_per_s']:.2f} | {steps} | {forward} | {loop} |")
        lines += ["", "Exactness: " + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in e2e["exact"].items())]
    lines += ["", f"Environment: {json.dumps(result['environment'])}", ""]
    return "\n".join(lines)


def _guard_sentence(result: dict) -> str:
    """The guard check per compiled call (at all threads), where the report measured it."""
    guards = result.get("guard_check_ms")
    if not guards:
        return ""
    per_shape = ", ".join(f"{k.replace('_', ' ')} {v:.2f} ms" for k, v in guards.items())
    return f". Dynamo's guard check per compiled call ({result['guards']}): {per_shape}"


def _llamacpp_info(gguf: str, floors: dict) -> dict:
    import importlib.metadata

    version = importlib.metadata.version("llama_cpp_python")
    return {
        "gguf": os.path.basename(gguf),
        "gguf_bytes": os.path.getsize(gguf),
        "floor_ms": floors["llamacpp_q8_0"],
        "version": version,
    }


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantized", required=True, help="a saved Quasar checkpoint")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds alternating the modes")
    parser.add_argument("--prompts", type=int, default=4, help="grounded prompts end to end (0: steps only)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend ('aot_eager': a quick mechanics check)")
    parser.add_argument(
        "--gguf", default=None, help="a Q8_0 GGUF of the same checkpoint: time llama.cpp's steps in the same rounds"
    )
    parser.add_argument(
        "--plain-guards", action="store_true", help="compile without step_compiler.compiled_step's dict-tag guards (to compare)"
    )
    parser.add_argument("--out", default=reports_dir("compiled-steps"))
    parser.add_argument("--name", required=True)
    args = parser.parse_args(argv)
    if args.gguf and not os.path.isfile(args.gguf):
        raise SystemExit(f"--gguf {args.gguf}: no such file (convert the checkpoint first: quasar_hf/bench/llamacpp_peer.py)")
    from benchmarks.kernels.kernels import measure_read_bandwidth
    from quasar_hf.bench.report import environment

    model = AutoModelForCausalLM.from_pretrained(args.quantized).eval()
    read_gbps = measure_read_bandwidth(torch.device("cpu"))
    floor_ms = step_read_bytes(model) / (read_gbps * 1e9) * 1e3
    floors = {"model": floor_ms}
    if args.gguf:  # llama.cpp reads its whole file per step (Q8_0 weights, its output matrix, norms)
        floors["llamacpp_q8_0"] = os.path.getsize(args.gguf) / (read_gbps * 1e9) * 1e3
    compile_config = compat.default_compile_config(torch.device("cpu"))
    if args.backend != "inductor":
        compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=args.backend)
    # --plain-guards: Dynamo's default guards (every tensor checked at every call), to compare the guard check
    compiled_step = (
        model.get_compiled_call(compile_config) if args.plain_guards else step_compiler.compiled_step(model, compile_config)
    )
    variants: dict = {}  # more compiled steps to time beside the default one (none at present)
    with torch.no_grad():
        steps, compile_s = time_steps(model, compiled_step, args.steps, args.rounds, floors, variants, args.gguf)
        guards = guard_check_ms(model, compiled_step)
        overhead = op_overhead(model, CACHE_TOKENS)
        e2e = None
        if args.prompts:
            tokenizer = AutoTokenizer.from_pretrained(args.quantized)
            e2e = end_to_end(model, tokenizer, args.prompts, args.new_tokens, compile_config, args.gguf)
    result = {
        "command": "python -m benchmarks compiled-steps " + " ".join(sys.argv[2:] if argv is None else argv),
        "model": os.path.basename(os.path.normpath(args.quantized)),
        "dtype": str(model.dtype).replace("torch.", ""),
        "environment": environment(),
        "load_average_end": os.getloadavg(),
        "read_gbps": read_gbps,
        "floor_bytes": step_read_bytes(model),
        "floor_ms": floor_ms,
        "llamacpp": _llamacpp_info(args.gguf, floors) if args.gguf else None,
        "compile": json.loads(json.dumps(compile_config.to_dict(), default=repr)),
        "variants": list(variants),
        "compile_s": compile_s,
        "guards": "dynamo default" if args.plain_guards else "recursive dict tags (step_compiler.compiled_step)",
        "guard_check_ms": guards,
        "steps": steps,
        "op_overhead": overhead,
        "end_to_end": e2e,
    }
    return write_json_and_markdown(result, args.out, args.name, markdown)
