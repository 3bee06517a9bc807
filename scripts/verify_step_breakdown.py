"""Where a verify step's time goes (SmolLM2-135M W8A8, CPU), against the bytes it must read.

Times one forward of 1 and of 6 tokens over a 300-token cache (what decode and a 5-draft
verification run), split into W8A8 linears, attention, lm_head and the rest (norms, rotary,
residuals, cache updates, Python and module overhead), and compares the step with the floor
`bytes read / read bandwidth` (int8 weights + BF16 lm_head; read bandwidth measured in the same
process by reading a 512 MiB tensor once). Runs with all torch threads, then with one.

    python scripts/verify_step_breakdown.py [--quantized DIR] [--out benchmarks/verify_step_breakdown_cpu.json]
"""

import argparse
import json
import os
import time

import torch
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401
from quasar_hf import QuasarConfig
from quasar_hf.bench.kernels import measure_copy_bandwidth, measure_read_bandwidth
from quasar_hf.models import smollm2_135m_instruct
from quasar_hf.nn import W8A8Linear
from quasar_hf.ops import attention_cpu
from quasar_hf.speculative.kv_state import RowAlignedCache


class Timer:
    """Accumulates wall time of wrapped calls (the wrapping is this script's only instrumentation)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            return out

        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantized", default=None, help="a saved Quasar checkpoint (default: quantize now)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/verify_step_breakdown_cpu.json")
    args = parser.parse_args()
    model = (
        AutoModelForCausalLM.from_pretrained(args.quantized)
        if args.quantized
        else AutoModelForCausalLM.from_pretrained(
            smollm2_135m_instruct(), quantization_config=QuasarConfig(), dtype=torch.bfloat16
        )
    ).eval()
    copy_gbps = measure_copy_bandwidth(torch.device("cpu"))
    w8a8 = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    int8_bytes = sum(m.weight.numel() for m in w8a8)
    # q/k/v and gate/up share one kernel call (nn/shared_input.py): the first member runs it.
    kernel_calls = sum(1 for m in w8a8 if m.shared_input is None or m.shared_index == 0)
    lm_head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    read_gbps = measure_read_bandwidth(torch.device("cpu"))
    floor_ms = (int8_bytes + lm_head_bytes) / (read_gbps * 1e9) * 1e3

    linears, attention, lm_head = Timer(), Timer(), Timer()
    W8A8Linear.forward = linears.wrap(W8A8Linear.forward)  # instrumentation of this script only
    attention_cpu.rowstable_attention = attention.wrap(attention_cpu.rowstable_attention)
    model.lm_head.forward = lm_head.wrap(model.lm_head.forward)
    rows = {}
    threads = torch.get_num_threads()
    with torch.no_grad():
        state = RowAlignedCache(model, 1, torch.device("cpu"))
        state.forward(torch.randint(0, model.config.vocab_size, (1, 300)))
        for count in sorted({threads, 1}, reverse=True):
            torch.set_num_threads(count)
            for tokens in (1, 6):
                state.forward(torch.randint(0, model.config.vocab_size, (1, tokens)))  # warm-up
                state.keep_appended(torch.tensor([0]), tokens)
                for t in (linears, attention, lm_head):
                    t.seconds = 0.0
                start = time.perf_counter()
                for _ in range(args.steps):
                    state.forward(torch.randint(0, model.config.vocab_size, (1, tokens)))
                    state.keep_appended(torch.tensor([0]), tokens)  # back to the same 300-token cache
                step = (time.perf_counter() - start) / args.steps * 1e3
                parts = {"w8a8_linears_ms": linears.seconds, "attention_ms": attention.seconds, "lm_head_ms": lm_head.seconds}
                parts = {k: v / args.steps * 1e3 for k, v in parts.items()}
                row = {"threads": count, "tokens": tokens, "step_ms": step, **parts}
                row.update(rest_ms=step - sum(parts.values()), x_floor=step / floor_ms)
                rows[f"{count}x{tokens}"] = row
                print(count, tokens, {k: round(v, 2) for k, v in row.items()})
        torch.set_num_threads(threads)
    from quasar_hf.bench.report import environment

    result = {
        "command": "python scripts/verify_step_breakdown.py " + " ".join(os.sys.argv[1:]),
        "environment": environment(),
        "load_average_end": os.getloadavg(),
        "torch_threads": threads,
        "copy_gbps_read_plus_write": copy_gbps,
        "read_gbps": read_gbps,
        "int8_weight_bytes": int8_bytes,
        "w8a8_module_calls": len(w8a8),
        "w8a8_kernel_calls": kernel_calls,
        "lm_head_bytes": lm_head_bytes,
        "floor_ms": floor_ms,
        "cache_tokens": 300,
        "steps": args.steps,
        "model": f"saved checkpoint {os.path.basename(os.path.normpath(args.quantized))}"
        if args.quantized
        else "QuasarConfig() defaults quantized in the run",
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    with open(args.out.removesuffix(".json") + ".md", "w") as f:
        f.write(to_markdown(result))


def to_markdown(d: dict) -> str:
    """The table and the arithmetic behind its floor column."""
    env = d.get("environment", {})
    lines = [
        "# Verify step time vs the bytes it reads (SmolLM2-135M W8A8, this CPU)",
        "",
        f"Command: `{d['command'].strip()}` ({d.get('model', 'QuasarConfig() defaults quantized in the run')}; "
        f"{d['cache_tokens']}-token "
        f"cache; mean of {d.get('steps', 20)} forwards after one warm-up; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in d['load_average_end'])}; CPU {env.get('cpu', '?')}, commit {env.get('git_commit', '?')}).",
        "",
        f"Bytes a step must read: {d['int8_weight_bytes'] / 1e6:.1f} MB of INT8 weights + {d['lm_head_bytes'] / 1e6:.1f} MB "
        f"of BF16 `lm_head` (tied embeddings; the 300-token KV cache, 6.9 MB, is left out). Read bandwidth measured "
        f"in the run: {d['read_gbps']:.1f} GB/s (copy: {d['copy_gbps_read_plus_write']:.1f} GB/s read + write), so a "
        f"floor of **{d['floor_ms']:.1f} ms**.",
        "",
        f"| threads | tokens per forward | step (ms) | W8A8 linears ({d['w8a8_module_calls']} module calls, "
        f"{d['w8a8_kernel_calls']} kernel calls) | attention (30 calls) | lm_head | rest | x floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"].values():
        label = "1 (decode)" if r["tokens"] == 1 else f"{r['tokens']} (verify {r['tokens'] - 1} drafts)"
        lines.append(
            f"| {r['threads']} | {label} | {r['step_ms']:.1f} | {r['w8a8_linears_ms']:.1f} | {r['attention_ms']:.1f} | "
            f"{r['lm_head_ms']:.1f} | {r['rest_ms']:.1f} | {r['x_floor']:.2f} |"
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
