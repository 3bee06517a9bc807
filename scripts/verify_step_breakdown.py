"""Where a verify step's time goes (SmolLM2-135M W8A8, CPU), against the bytes it must read.

Times one forward of 1 and of 6 tokens over a 300-token cache (what decode and a 5-draft
verification run), split into W8A8 linears, attention, lm_head and the rest (norms, rotary,
residuals, cache updates, Python and module overhead), and compares the step with the floor
`bytes read / read bandwidth` (int8 weights + BF16 lm_head; read bandwidth = half the measured
copy bandwidth, which counts read + write).

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
from quasar_hf.bench.kernels import measure_copy_bandwidth
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
    floor_ms = (int8_bytes + lm_head_bytes) / (copy_gbps / 2 * 1e9) * 1e3

    linears, attention, lm_head = Timer(), Timer(), Timer()
    W8A8Linear.forward = linears.wrap(W8A8Linear.forward)  # instrumentation of this script only
    attention_cpu.rowstable_attention = attention.wrap(attention_cpu.rowstable_attention)
    model.lm_head.forward = lm_head.wrap(model.lm_head.forward)
    rows = {}
    with torch.no_grad():
        state = RowAlignedCache(model, 1, torch.device("cpu"))
        state.forward(torch.randint(0, model.config.vocab_size, (1, 300)))
        for tokens in (1, 6):
            for t in (linears, attention, lm_head):
                t.seconds = 0.0
            start = time.perf_counter()
            for _ in range(args.steps):
                state.forward(torch.randint(0, model.config.vocab_size, (1, tokens)))
                state.keep_appended(torch.tensor([0]), tokens)  # back to the same 300-token cache
            step = (time.perf_counter() - start) / args.steps * 1e3
            parts = {"w8a8_linears_ms": linears.seconds, "attention_ms": attention.seconds, "lm_head_ms": lm_head.seconds}
            parts = {k: v / args.steps * 1e3 for k, v in parts.items()}
            rows[tokens] = {"step_ms": step, **parts, "rest_ms": step - sum(parts.values()), "x_floor": step / floor_ms}
            print(tokens, {k: round(v, 2) for k, v in rows[tokens].items()})
    result = {
        "command": "python scripts/verify_step_breakdown.py " + " ".join(os.sys.argv[1:]),
        "load_average_end": os.getloadavg(),
        "torch_threads": torch.get_num_threads(),
        "copy_gbps_read_plus_write": copy_gbps,
        "int8_weight_bytes": int8_bytes,
        "w8a8_module_calls": len(w8a8),
        "w8a8_kernel_calls": kernel_calls,
        "lm_head_bytes": lm_head_bytes,
        "floor_ms": floor_ms,
        "cache_tokens": 300,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    with open(args.out.removesuffix(".json") + ".md", "w") as f:
        f.write(to_markdown(result))


def to_markdown(d: dict) -> str:
    """The table and how to read it."""
    lines = [
        "# Verify step time vs the bytes it reads (SmolLM2-135M W8A8, this CPU)",
        "",
        f"Command: `{d['command'].strip()}` (`QuasarConfig()` defaults quantized in the run; {d['cache_tokens']}-token "
        f"cache; mean of 20 forwards; {d['torch_threads']} threads; load average at the end "
        f"{', '.join(f'{x:.2f}' for x in d['load_average_end'])}).",
        "",
        f"Bytes a step must read: {d['int8_weight_bytes'] / 1e6:.1f} MB of INT8 weights + {d['lm_head_bytes'] / 1e6:.1f} MB "
        f"of BF16 `lm_head` (tied embeddings; the 300-token KV cache, 6.9 MB, is left out). Measured copy bandwidth "
        f"{d['copy_gbps_read_plus_write']:.1f} GB/s (read + write), so a read floor of **{d['floor_ms']:.1f} ms** (the "
        "copy figure varies between about 31 and 49 GB/s from run to run on this shared VM).",
        "",
        f"| tokens per forward | step (ms) | W8A8 linears ({d['w8a8_module_calls']} module calls, "
        f"{d['w8a8_kernel_calls']} kernel calls) | attention (30 calls) | lm_head | rest | x floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, key in (("1 (decode)", "1"), ("6 (verify 5 drafts)", "6")):
        r = d["rows"][key]
        lines.append(
            f"| {label} | {r['step_ms']:.1f} | {r['w8a8_linears_ms']:.1f} | {r['attention_ms']:.1f} | "
            f"{r['lm_head_ms']:.1f} | {r['rest_ms']:.1f} | {r['x_floor']:.1f} |"
        )
    r1, r6 = d["rows"]["1"], d["rows"]["6"]
    lines += [
        "",
        f"Reading: verifying 6 tokens costs {r6['step_ms'] / r1['step_ms']:.2f}x one decode step, which is what "
        "speculative decoding lives on. The step is above the memory floor because of fixed costs, not bytes: "
        f"the W8A8 linears stream their {d['int8_weight_bytes'] / 1e6:.0f} MB at "
        f"~{d['int8_weight_bytes'] / 1e6 / r6['w8a8_linears_ms']:.1f} GB/s (q/k/v and gate/up share one input "
        f"quantization and one kernel call per layer, so {d['w8a8_kernel_calls']} kernel calls each pay module, Python "
        'and ctypes overhead), and the "rest" (RMSNorms, rotary, residual adds, KV-cache writes and Transformers\' '
        "module overhead: over a thousand small torch ops per step) costs about as much. Next step this table points "
        "to: the norm fused into the quantization.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
