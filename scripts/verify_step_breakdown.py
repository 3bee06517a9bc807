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
    model = (AutoModelForCausalLM.from_pretrained(args.quantized) if args.quantized else AutoModelForCausalLM.from_pretrained(
        smollm2_135m_instruct(), quantization_config=QuasarConfig(), dtype=torch.bfloat16)).eval()
    copy_gbps = measure_copy_bandwidth(torch.device("cpu"))
    int8_bytes = sum(m.weight.numel() for m in model.modules() if isinstance(m, W8A8Linear))
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
    result = {"command": "python scripts/verify_step_breakdown.py " + " ".join(os.sys.argv[1:]),
              "load_average_end": os.getloadavg(), "torch_threads": torch.get_num_threads(),
              "copy_gbps_read_plus_write": copy_gbps, "int8_weight_bytes": int8_bytes, "lm_head_bytes": lm_head_bytes,
              "floor_ms": floor_ms, "cache_tokens": 300, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
