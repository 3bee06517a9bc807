"""The arithmetic floor of a quantization: its phases' FLOPs over this machine's GEMM rates.

For a Llama-shaped decoder (hidden H, MLP I, KV width Hkv, L layers) calibrated on N tokens in
blocks of T with `QuasarConfig()` defaults, per layer:

- statistics forward: 2 N (linear weights) + 2 N T H (causal attention: QK^T and PV, half the keys);
- Hessians (GPTQ): per distinct linear input (q/k/v share one, gate/up share one, o, down), the
  tiles of x^T x on or above the diagonal (calibration.upper_gram_add): about N K (K + GRAM_TILE);
- alpha search (alpha="auto", linear search): per mapping, a reference and 11 grid products on S
  sampled rows: 12 x 2 S K N;
- GPTQ rounding: 2 N_out K^2 per linear (the error updates) and K^3 / 3 per distinct input (one
  Cholesky, shared by the linears rounded together);
- rotation of a rotated input's Hessian (Q^T H Q as matrix products from the left, twice,
  hadamard.rotate_columns_gemm): 4 K^2 (n + m) for K = c m n (H_n direct), or 4 K^2 (a + b + m) past
  DIRECT_SYLVESTER_MAX (H_n = H_a (x) H_b); no m term when m = 1.

Everything else (capture, folding, packing) is small. The rate is the best of nine [T, H] x [H, I] matmuls in
the same process with the threads torch uses: the statistics forward at the rate of the dtype
calibration computed in (`calibration_info["math_dtype"]`: bf16 where the CPU has it natively), the
other phases at the fp32 rate, the dtype they compute in whatever the model's. The floor is what
the phases would take at those rates.
"""

from __future__ import annotations

import time

import torch

from quasar_hf.ops.hadamard import HadamardRotation, sylvester_split
from quasar_hf.smoothquant.calibration import GRAM_TILE

SAMPLED_ROWS = 256  # QuasarConfig.calibration_sample_rows
ALPHA_GRID = 11


FP32_PHASES = ("hessians", "alpha_search", "gptq_rounding", "hessian_rotation")  # fp32 whatever the math dtype


def gemm_gflops(rows: int, hidden: int, inter: int, dtype: torch.dtype = torch.float32, repeats: int = 9) -> float:
    """Best GFLOPS of a [rows, hidden] @ [hidden, inter] matmul in `dtype` over `repeats` runs (torch's
    threads): the rate the machine reaches, so a slow run beside other work cannot lower the floor."""
    a, b = torch.randn(rows, hidden, dtype=dtype), torch.randn(hidden, inter, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * rows * hidden * inter / best / 1e9


def gram_flop(tokens: int, k: int) -> int:
    """FLOPs of summing x^T x over `tokens` rows of width k by upper tiles (calibration.upper_gram_add)."""
    return sum(2 * tokens * min(GRAM_TILE, k - start) * (k - start) for start in range(0, k, GRAM_TILE))


def rotation_gemm_flop(k: int) -> int:
    """FLOPs of Q^T H Q for a [k, k] H by hadamard.rotate_columns_gemm (twice: Q^T H, then Q^T of its transpose)."""
    rotation = HadamardRotation.for_size(k)
    a, b = sylvester_split(rotation.pow2)
    per_element = b + (a if a > 1 else 0) + (rotation.odd_order if rotation.odd_order > 1 else 0)
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
        "gptq_rounding": (sum(2 * n * k * k for k, n in linears.values()) + sum(k**3 // 3 for k in inputs.values()))
        if gptq
        else 0,
        "hessian_rotation": rotation_gemm_flop(inter) if (gptq and rotate_down) else 0,
    }
    return {name: layers * flop / 1e9 for name, flop in per_layer.items()}


def floor_seconds(config, tokens: int, seq_len: int, math_dtype: str = "float32", **options) -> dict:
    """{"gflop": per phase, "fp32_gflops" and "math_gflops": measured rates, "floor_s": the statistics
    forward at the `math_dtype` rate plus the other phases at the fp32 rate}."""
    gflop = phase_gflop(config, tokens, seq_len, **options)
    shape = (seq_len, config.hidden_size, config.intermediate_size)
    fp32_rate = gemm_gflops(*shape)
    math_rate = fp32_rate if math_dtype == "float32" else gemm_gflops(*shape, dtype=getattr(torch, math_dtype))
    seconds = sum(v / (fp32_rate if k in FP32_PHASES else math_rate) for k, v in gflop.items())
    return {
        "gflop": {k: round(v, 1) for k, v in gflop.items()},
        "fp32_gflops": round(fp32_rate, 1),
        "math_dtype": math_dtype,
        "math_gflops": round(math_rate, 1),
        "floor_s": round(seconds, 1),
    }


FLOOR_HEADING = (
    "Quantize time against the arithmetic floor (phase FLOPs / GEMM rates measured in the same process: the "
    "statistics forward in the calibration math dtype, the other phases in fp32; benchmarks/quantize/quantize_floor.py):"
)


def rates_cell(floor: dict) -> str:
    """The GEMM rates a floor used, for a report's table: "182.3" (fp32 only) or "182.3 / 421.7 bfloat16"."""
    math_dtype = floor.get("math_dtype", "float32")
    if math_dtype == "float32":
        return str(floor["fp32_gflops"])
    return f"{floor['fp32_gflops']} / {floor['math_gflops']} {math_dtype}"


def floor_of_quantized(model) -> dict:
    """`floor_seconds` for a model just quantized on load: its HF config, and the calibration tokens
    and settings its `calibration_info` and `QuasarConfig` record."""
    qconfig = model.config.quantization_config
    info = qconfig.calibration_info
    return floor_seconds(
        model.config,
        info["tokens"],
        info["seq_len"],
        math_dtype=info.get("math_dtype") or "float32",
        gptq=qconfig.weight_rounding == "gptq",
        rotate_down="down_proj" in (qconfig.rotate or []),
        alpha_auto=qconfig.alpha == "auto",
    )
