"""The arithmetic floor of a quantization: its phases' FLOPs over the fp32 GEMM rate of this machine.

For a Llama-shaped decoder (hidden H, MLP I, KV width Hkv, L layers) calibrated on N tokens in
blocks of T with `QuasarConfig()` defaults, per layer:

- statistics forward: 2 N (linear weights) + 2 N T H (causal attention: QK^T and PV, half the keys);
- Hessians (GPTQ): per distinct linear input (q/k/v share one, gate/up share one, o, down), the
  tiles of x^T x on or above the diagonal (calibration.upper_gram_add): about N K (K + GRAM_TILE);
- alpha search (alpha="auto", linear search): per mapping, a reference and 11 grid products on S
  sampled rows: 12 x 2 S K N;
- GPTQ rounding: 2 N_out K^2 + K^3 per linear (updates, and the Cholesky inverse);
- rotation of a rotated input's Hessian (Q^T H Q as matrix products on its rows, twice,
  hadamard.rotate_rows_gemm): 4 K^2 (n + m) for K = m n (H_n direct), or 4 K^2 (a + b + m) past
  DIRECT_SYLVESTER_MAX (H_n = H_a (x) H_b).

Everything else (capture, folding, packing) is small. The rate is a fp32 [T, H] x [H, I] matmul
timed in the same process with the threads torch uses: the floor is what the phases would take at
that rate.
"""

from __future__ import annotations

import time

import torch

from quasar_hf.ops.hadamard import DIRECT_SYLVESTER_MAX, HadamardRotation
from quasar_hf.smoothquant.calibration import GRAM_TILE

SAMPLED_ROWS = 256  # QuasarConfig.calibration_sample_rows
ALPHA_GRID = 11


def fp32_gemm_gflops(rows: int, hidden: int, inter: int, repeats: int = 5) -> float:
    """Median GFLOPS of a fp32 [rows, hidden] @ [hidden, inter] matmul (torch's threads)."""
    a, b = torch.randn(rows, hidden), torch.randn(hidden, inter)
    a @ b  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2 * rows * hidden * inter / sorted(times)[len(times) // 2] / 1e9


def gram_flop(tokens: int, k: int) -> int:
    """FLOPs of summing x^T x over `tokens` rows of width k by upper tiles (calibration.upper_gram_add)."""
    return sum(2 * tokens * min(GRAM_TILE, k - start) * (k - start) for start in range(0, k, GRAM_TILE))


def rotation_gemm_flop(k: int) -> int:
    """FLOPs of Q^T H Q for a [k, k] H by hadamard.rotate_rows_gemm (rows, then the transpose's rows)."""
    rotation = HadamardRotation.for_size(k)
    n = rotation.pow2
    a = 1 if n <= DIRECT_SYLVESTER_MAX else 1 << (n.bit_length() - 1) // 2
    per_element = (n // a) + (a if a > 1 else 0) + rotation.odd_order
    return 2 * 2 * k * k * per_element


def phase_gflop(config, tokens: int, seq_len: int, gptq: bool = True, rotate_down: bool = True, alpha_auto: bool = True) -> dict:
    """GFLOP per phase for the whole model (see the module docstring); `config` is the HF config."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) * getattr(config, "head_dim", h // heads)
    linears = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "gate": (h, inter), "up": (h, inter), "down": (inter, h)}
    weights = sum(k * n for k, n in linears.values())  # per layer
    inputs = {"qkv": h, "o": h, "gate_up": h, "down": inter}  # distinct inputs: Hessians and samples
    per_layer = {
        "statistics_forward": 2 * tokens * weights + 2 * tokens * seq_len * h,
        "hessians": sum(gram_flop(tokens, k) for k in inputs.values()) if gptq else 0,
        "alpha_search": (12 * 2 * SAMPLED_ROWS * (h * (h + 2 * kv) + h * h + h * 2 * inter + (0 if rotate_down else inter * h)))
        if alpha_auto
        else 0,
        "gptq_rounding": sum(2 * n * k * k + k**3 for k, n in linears.values()) if gptq else 0,
        "hessian_rotation": rotation_gemm_flop(inter) if (gptq and rotate_down) else 0,
    }
    return {name: layers * flop / 1e9 for name, flop in per_layer.items()}


def floor_seconds(config, tokens: int, seq_len: int, **options) -> dict:
    """{"gflop": per phase, "fp32_gflops": measured rate, "floor_s": total GFLOP / rate}."""
    gflop = phase_gflop(config, tokens, seq_len, **options)
    rate = fp32_gemm_gflops(seq_len, config.hidden_size, config.intermediate_size)
    return {
        "gflop": {k: round(v, 1) for k, v in gflop.items()},
        "fp32_gflops": round(rate, 1),
        "floor_s": round(sum(gflop.values()) / rate, 1),
    }


def floor_of_quantized(model) -> dict:
    """`floor_seconds` for a model just quantized on load: its HF config, and the calibration tokens
    and settings its `calibration_info` and `QuasarConfig` record."""
    qconfig = model.config.quantization_config
    info = qconfig.calibration_info
    return floor_seconds(
        model.config,
        info["tokens"],
        info["seq_len"],
        gptq=qconfig.weight_rounding == "gptq",
        rotate_down="down_proj" in (qconfig.rotate or []),
        alpha_auto=qconfig.alpha == "auto",
    )
