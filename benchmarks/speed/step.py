"""Where a verify step's time goes (a Quasar W8A8 checkpoint, CPU), against the bytes it must read.

Times one forward of 1 and of 6 tokens over a 300-token cache (what decode and a 5-draft
verification run), split into W8A8 linears (with the RMSNorms folded into them: NormFoldedW8A8Linear),
attention (the function the model's layers call from Transformers' attention registry: for a Quasar
model `rowstable_attention_forward`, with the C kernel or SDPA it picks), lm_head and the rest (other
norms, rotary, residuals, cache updates, Python and module overhead), and compares the step with the
floor `bytes read / read bandwidth` (int8 weights + BF16 lm_head, `nn.weight_bytes`; read bandwidth measured in the same
process by reading a 512 MiB tensor once). Runs with all torch threads, then with one. The same steps
with the projections unfused (hf/fusion.py: each norm alone, each projection its own W8A8) are timed
interleaved with the fused ones, so the fusion's effect is a ratio measured side by side. Without
--quantized, SmolLM2-135M is quantized with QuasarConfig().

--gguf FILE (a Q8_0 GGUF of the same checkpoint; needs llama-cpp-python) also times llama.cpp's
forward of the same token counts over a 300-token cache in the same process, against its own
floor (GGUF bytes / the same read bandwidth): the step a CPU user would otherwise run.

    python -m benchmarks step [--quantized DIR] [--out benchmarks/reports/step/verify_step_breakdown_cpu.json]
"""

import argparse
import contextlib
import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Iterator

import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import quasar_hf  # noqa: F401
from benchmarks.kernels.kernels import measure_copy_bandwidth, measure_read_bandwidth
from quasar_hf import QuasarConfig, compat
from quasar_hf.hf.fusion import fuse_projections, unfuse_projections
from quasar_hf.models import smollm2_135m_instruct
from quasar_hf.nn import NormFoldedW8A8Linear, W8A8Linear
from quasar_hf.nn.weight_bytes import step_read_bytes, step_weight_bytes
from quasar_hf.speculative.row_aligned_cache import RowAlignedCache


class Timer:
    """Accumulates wall time and count of wrapped calls (the wrapping is this script's only instrumentation)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out

        return timed


@contextlib.contextmanager
def instrumented(model) -> Iterator[dict[str, Timer]]:
    """Timers of the W8A8 linears (plain and norm-folded), the attention function the model's layers
    call, and the lm_head, wrapped around them for the `with` block and removed after it."""
    timers = {"w8a8_linears": Timer(), "attention": Timer(), "lm_head": Timer()}
    attention_name = compat.attn_implementation(model)
    if attention_name not in ALL_ATTENTION_FUNCTIONS:
        raise SystemExit(f"the model's attention {attention_name!r} is not in Transformers' registry: nothing to time")
    attention = ALL_ATTENTION_FUNCTIONS[attention_name]
    forwards = {cls: cls.forward for cls in (W8A8Linear, NormFoldedW8A8Linear)}
    lm_head_forward = model.lm_head.__dict__.get("forward")  # an instance's own forward (a hook's), if any
    try:
        for cls, forward in forwards.items():
            cls.forward = timers["w8a8_linears"].wrap(forward)  # a norm and its stacked projections count as one
        ALL_ATTENTION_FUNCTIONS[attention_name] = timers["attention"].wrap(attention)  # this registry only
        model.lm_head.forward = timers["lm_head"].wrap(model.lm_head.forward)
        yield timers
    finally:
        for cls, forward in forwards.items():
            cls.forward = forward
        ALL_ATTENTION_FUNCTIONS[attention_name] = attention
        if lm_head_forward is None:
            model.lm_head.__dict__.pop("forward", None)
        else:
            model.lm_head.forward = lm_head_forward


def kv_cache_bytes(config, tokens: int) -> int:
    """BF16 keys and values of `tokens` positions in every layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * 2 * config.num_hidden_layers * kv_heads * head_dim * tokens


ROUNDS = 4  # folded and unfolded measurements alternate this many times per row


def set_folded(model, folded: bool) -> int:
    """Fuse every fusable group (True) or undo every fusion (False); returns how many are fused."""
    unfuse_projections(model)
    return fuse_projections(model) if folded else 0


def llamacpp_steps(gguf: str, thread_counts: list[int], steps: int, floor_ms: float) -> dict:
    """llama.cpp forwards of 1 and 6 tokens (all logits) over a 300-token cache, per thread count."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit("--gguf needs llama-cpp-python (see quasar_hf/bench/llamacpp_peer.py for the install)") from None
    generator = torch.Generator().manual_seed(0)
    rows = {}
    for count in thread_counts:
        llm = Llama(
            model_path=gguf, n_ctx=512, n_batch=512, n_threads=count, n_threads_batch=count, logits_all=True, verbose=False
        )
        llm.eval(torch.randint(0, llm.n_vocab(), (300,), generator=generator).tolist())
        for tokens in (1, 6):
            new = torch.randint(0, llm.n_vocab(), (tokens,), generator=generator).tolist()
            for _ in range(2):  # warm-up
                llm.n_tokens = 300  # back to the same 300-token cache
                llm.eval(new)
            start = time.perf_counter()
            for _ in range(steps):
                llm.n_tokens = 300
                llm.eval(new)
            step = (time.perf_counter() - start) / steps * 1e3
            rows[f"{count}x{tokens}"] = {"threads": count, "tokens": tokens, "step_ms": step, "x_floor": step / floor_ms}
            print("llama.cpp", count, tokens, round(step, 2))
        del llm
    return rows


def load_model(quantized: str | None):
    """The saved Quasar checkpoint, else SmolLM2-135M quantized now with QuasarConfig()."""
    if quantized:
        return AutoModelForCausalLM.from_pretrained(quantized).eval()
    return AutoModelForCausalLM.from_pretrained(
        smollm2_135m_instruct(), quantization_config=QuasarConfig(), dtype=torch.bfloat16
    ).eval()


def time_steps(model, cache_tokens: int, steps: int) -> tuple[dict, dict, int]:
    """(folded rows, unfolded rows, norm folds): forwards of 1 and 6 tokens over a `cache_tokens`
    cache, all threads then one, folded and unfolded interleaved (ROUNDS times). Each row holds the
    milliseconds and the calls per forward of the step and of each timed part."""
    threads = torch.get_num_threads()
    rows, unfolded_rows = {}, {}
    folds = set_folded(model, True)
    per_round = max(1, steps // ROUNDS)
    with instrumented(model) as timers, torch.no_grad():

        def timed(state, tokens: int, count: int) -> dict:
            for timer in timers.values():
                timer.reset()
            start = time.perf_counter()
            for _ in range(count):
                state.forward(torch.randint(0, model.config.vocab_size, (1, tokens)))
                state.keep_accepted(torch.tensor([0]), tokens)  # back to the same cache
            out = {"seconds": time.perf_counter() - start}
            for name, timer in timers.items():
                out |= {f"{name}_ms": timer.seconds, f"{name}_calls": timer.calls / count}
            return out

        state = RowAlignedCache(model, 1, torch.device("cpu"))
        state.forward(torch.randint(0, model.config.vocab_size, (1, cache_tokens)))
        for count in sorted({threads, 1}, reverse=True):
            torch.set_num_threads(count)
            for tokens in (1, 6):
                totals = {True: {}, False: {}}
                for _ in range(ROUNDS):
                    for folded in (True, False) if folds else (True,):
                        set_folded(model, folded)
                        timed(state, tokens, 1)  # warm-up (binds the kernels after a toggle)
                        for k, v in timed(state, tokens, per_round).items():
                            totals[folded][k] = totals[folded].get(k, 0.0) + v
                set_folded(model, True)
                for folded, out in ((True, rows), (False, unfolded_rows)):
                    if totals[folded]:
                        out[f"{count}x{tokens}"] = _row(totals[folded], count, tokens, ROUNDS * per_round)
                        print("folded" if folded else "unfolded", count, tokens, out[f"{count}x{tokens}"])
        torch.set_num_threads(threads)
    return rows, unfolded_rows, folds


def _row(total: dict, threads: int, tokens: int, forwards: int) -> dict:
    """Milliseconds per forward of the step and of each timed part, and the rest."""
    step = total["seconds"] / forwards * 1e3
    parts = {k: v / forwards * 1e3 for k, v in total.items() if k.endswith("_ms")}
    calls = {k: v / ROUNDS for k, v in total.items() if k.endswith("_calls")}  # each round adds its calls per forward
    return {"threads": threads, "tokens": tokens, "step_ms": step, **parts, "rest_ms": step - sum(parts.values()), **calls}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantized", default=None, help="a saved Quasar checkpoint (default: quantize now)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cache-tokens", type=int, default=300, help="tokens in the cache each step reads")
    parser.add_argument("--bandwidth-mib", type=int, default=512, help="size of the tensor read to measure bandwidth")
    parser.add_argument("--out", default="benchmarks/reports/step/verify_step_breakdown_cpu.json")
    parser.add_argument("--gguf", default=None, help="a Q8_0 GGUF of the same checkpoint: time llama.cpp's step too")
    args = parser.parse_args(argv)
    if args.gguf and not os.path.isfile(args.gguf):
        raise SystemExit(f"--gguf {args.gguf}: no such file (convert the checkpoint first: bench/llamacpp_peer.py)")
    model = load_model(args.quantized)
    copy_gbps = measure_copy_bandwidth(torch.device("cpu"), args.bandwidth_mib)
    w8a8 = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    weights = step_weight_bytes(model)  # int8 weights + the float lm_head (and any linear kept in float)
    read_gbps = measure_read_bandwidth(torch.device("cpu"), args.bandwidth_mib)
    floor_ms = step_read_bytes(model) / (read_gbps * 1e9) * 1e3
    threads = torch.get_num_threads()
    rows, unfolded_rows, folds = time_steps(model, args.cache_tokens, args.steps)
    first = next(iter(rows.values()))
    for row in (*rows.values(), *unfolded_rows.values()):
        row["x_floor"] = row["step_ms"] / floor_ms
    llamacpp = None
    if args.gguf:
        gguf_bytes = os.path.getsize(args.gguf)
        llama_floor = gguf_bytes / (read_gbps * 1e9) * 1e3
        rows_llama = llamacpp_steps(args.gguf, sorted({threads, 1}, reverse=True), args.steps, llama_floor)
        version = importlib.metadata.version("llama_cpp_python")
        llamacpp = {"gguf": os.path.basename(args.gguf), "gguf_bytes": gguf_bytes, "floor_ms": llama_floor}
        llamacpp.update(version=version, rows=rows_llama)
    from quasar_hf.bench.report import environment

    result = {
        "command": "python -m benchmarks step " + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": environment(),
        "load_average_end": os.getloadavg(),
        "torch_threads": threads,
        "copy_gbps_read_plus_write": copy_gbps,
        "read_gbps": read_gbps,
        "int8_weight_bytes": weights["int8"],
        "w8a8_module_calls": len(w8a8),
        "w8a8_kernel_calls": round(first["w8a8_linears_calls"]),  # one op per (stacked) linear
        "attention_calls": round(first["attention_calls"]),
        "lm_head_bytes": weights["float"],  # the float linears: the lm_head, unless some are kept in float
        "floor_ms": floor_ms,
        "cache_tokens": args.cache_tokens,
        "steps": ROUNDS * max(1, args.steps // ROUNDS),
        "norm_folds": folds,
        "tied_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        "kv_cache_bytes": kv_cache_bytes(model.config, args.cache_tokens),
        "layers": model.config.num_hidden_layers,
        "model_name": os.path.basename(os.path.normpath(args.quantized)) if args.quantized else "SmolLM2-135M-Instruct",
        "model": f"saved checkpoint {os.path.basename(os.path.normpath(args.quantized))}"
        if args.quantized
        else "QuasarConfig() defaults quantized in the run",
        "rows": rows,
        "unfolded_rows": unfolded_rows,
        "llamacpp": llamacpp,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    with open(args.out.removesuffix(".json") + ".md", "w") as f:
        f.write(to_markdown(result))


def to_markdown(d: dict) -> str:
    """The table and the arithmetic behind its floor column."""
    env = d.get("environment", {})
    lines = [
        f"# Verify step time vs the bytes it reads ({d.get('model_name', 'SmolLM2-135M W8A8')}, this CPU)",
        "",
        f"Command: `{d['command'].strip()}` ({d.get('model', 'QuasarConfig() defaults quantized in the run')}; "
        f"{d['cache_tokens']}-token "
        f"cache; mean of {d.get('steps', 20)} forwards after one warm-up; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in d['load_average_end'])}; CPU {env.get('cpu', '?')}, commit {env.get('git_commit', '?')}).",
        "",
        f"Bytes a step must read: {d['int8_weight_bytes'] / 1e6:.1f} MB of INT8 weights + {d['lm_head_bytes'] / 1e6:.1f} MB "
        f"of BF16 `lm_head` ({'tied embeddings; ' if d.get('tied_embeddings', True) else ''}the "
        f"{d['cache_tokens']}-token KV cache, {d.get('kv_cache_bytes', 6.9e6) / 1e6:.1f} MB, is left out). Read bandwidth measured "
        f"in the run: {d['read_gbps']:.1f} GB/s (copy: {d['copy_gbps_read_plus_write']:.1f} GB/s read + write), so a "
        f"floor of **{d['floor_ms']:.1f} ms**.",
        "",
        f"| threads | tokens per forward | step (ms) | W8A8 linears ({d['w8a8_module_calls']} module calls, "
        f"{d['w8a8_kernel_calls']} kernel calls) | attention ({d.get('attention_calls', d.get('layers', 30))} calls) | lm_head | "
        "rest | x floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"].values():
        label = "1 (decode)" if r["tokens"] == 1 else f"{r['tokens']} (verify {r['tokens'] - 1} drafts)"
        lines.append(
            f"| {r['threads']} | {label} | {r['step_ms']:.1f} | {r['w8a8_linears_ms']:.1f} | {r['attention_ms']:.1f} | "
            f"{r['lm_head_ms']:.1f} | {r['rest_ms']:.1f} | {r['x_floor']:.2f} |"
        )
    unfolded = d.get("unfolded_rows") or {}
    if unfolded:
        lines += [
            "",
            f"The same steps with the {d['norm_folds']} RMSNorm folds undone (norms computed by Transformers, then "
            "quantized), timed interleaved with the rows above:",
            "",
            "| threads | tokens per forward | norms folded (ms) | norms computed (ms) | saved |",
            "|---|---|---|---|---|",
        ]
        for key, r in d["rows"].items():
            u = unfolded[key]
            lines.append(
                f"| {r['threads']} | {r['tokens']} | {r['step_ms']:.1f} | {u['step_ms']:.1f} | "
                f"{u['step_ms'] - r['step_ms']:.1f} ms ({(1 - r['step_ms'] / u['step_ms']) * 100:.0f} %) |"
            )
    llama = d.get("llamacpp")
    if llama:
        lines += [
            "",
            f"llama.cpp (llama-cpp-python {llama['version']}) on `{llama['gguf']}` ({llama['gguf_bytes'] / 1e6:.1f} MB: "
            f"floor {llama['floor_ms']:.1f} ms at the same read bandwidth), same token counts and cache, all logits:",
            "",
            "| threads | tokens per forward | quasar step (ms) | x its floor | llama.cpp step (ms) | x its floor | llama.cpp / quasar |",
            "|---|---|---|---|---|---|---|",
        ]
        for key, r in d["rows"].items():
            other = llama["rows"].get(key)
            if other:
                lines.append(
                    f"| {r['threads']} | {r['tokens']} | {r['step_ms']:.1f} | {r['x_floor']:.2f} | {other['step_ms']:.1f} | "
                    f"{other['x_floor']:.2f} | {other['step_ms'] / r['step_ms']:.2f} |"
                )
    top = max(r["threads"] for r in d["rows"].values())
    r1, r6 = d["rows"][f"{top}x1"], d["rows"][f"{top}x6"]
    lines += [
        "",
        f"With {top} threads a 6-token step costs {r6['step_ms'] / r1['step_ms']:.2f}x a decode step; the W8A8 linears "
        f"stream their {d['int8_weight_bytes'] / 1e6:.0f} MB at {d['int8_weight_bytes'] / 1e6 / r6['w8a8_linears_ms']:.1f} "
        f"GB/s in the 6-token step (read bandwidth {d['read_gbps']:.1f} GB/s).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
