"""Time and peak memory of GPTQ rounding for one Llama-3.1-8B decoder layer's linears (random weights and inputs).

    OMP_NUM_THREADS=1 python scripts/gptq_layer_cost.py > benchmarks/gptq_8b_layer_cpu.json

Per linear: one 512-token block of the Hessian sum (x^T x) and the GPTQ rounding itself. A layer's
quantization adds num_calibration_samples blocks of the Hessian sum per distinct input (q/k/v share
one, gate/up another) plus one rounding per linear.
"""

from __future__ import annotations

import json
import resource
import time

import torch

from quasar_hf.bench.report import environment
from quasar_hf.smoothquant.gptq import gptq_round

SHAPES = {  # [out, in] of Llama-3.1-8B's decoder linears
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "v_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096),
    "up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}


def main() -> dict:
    torch.manual_seed(0)
    out: dict = {"command": "OMP_NUM_THREADS=1 python scripts/gptq_layer_cost.py", "threads": torch.get_num_threads()}
    for name, (n, k) in SHAPES.items():
        weight, x = torch.randn(n, k) * 0.02, torch.randn(512, k)
        start = time.perf_counter()
        hessian = x.t() @ x  # [K, K]
        block_s = time.perf_counter() - start
        start = time.perf_counter()
        gptq_round(weight, hessian, consume=True)
        out[name] = {"hessian_block_s": round(block_s, 3), "gptq_s": round(time.perf_counter() - start, 1)}
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["environment"] = environment()
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
