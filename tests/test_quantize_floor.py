"""The quantization floor counts the FLOPs the calibration code performs (torch's FLOP counter as oracle)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.quantize.quantize_floor import gram_flop, rotation_gemm_flop
from quasar_hf.ops.hadamard import HadamardRotation
from quasar_hf.smoothquant.calibration import GRAM_TILE, mirrored, upper_gram_add
from quasar_hf.smoothquant.gptq import rotated_hessian


class _MatmulFlops(TorchDispatchMode):
    """Counts 2 M N K per matrix product that reaches ATen (addmm_, which torch's FlopCounterMode skips, included)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "addmm_", "bmm"):
            a, b = (args[1], args[2]) if name.startswith("addmm") else (args[0], args[1])
            self.flops += 2 * a.shape[:-1].numel() * a.shape[-1] * b.shape[-1]
        return func(*args, **(kwargs or {}))


def _counted(fn) -> int:
    with _MatmulFlops() as counter:
        fn()
    return counter.flops


@pytest.mark.parametrize("k", [96, GRAM_TILE, GRAM_TILE + 40, 3 * GRAM_TILE - 7])
def test_gram_flops_match_the_tiled_sum_and_the_sum_is_x_transpose_x(k: int) -> None:
    x = torch.randn(33, k, dtype=torch.float64)
    upper = torch.zeros(k, k, dtype=torch.float64)
    assert _counted(lambda: upper_gram_add(upper, x)) == gram_flop(33, k)
    assert gram_flop(33, k) <= 2 * 33 * k * k
    torch.testing.assert_close(mirrored(upper), x.t() @ x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [96, 2048, 4864])
def test_rotation_flops_match_rotated_hessian(k: int) -> None:
    h = torch.zeros(k, k) if k > 1000 else torch.randn(k, k)
    counted = _counted(lambda: rotated_hessian(h, HadamardRotation.for_size(k)))
    assert counted == rotation_gemm_flop(k)


def test_floor_times_the_forward_at_the_math_dtype_rate_and_the_rest_at_fp32(monkeypatch) -> None:
    from transformers import LlamaConfig

    from benchmarks.quantize import quantize_floor

    rates = {torch.float32: 0.01, torch.bfloat16: 0.04}  # slow enough that the rounded floors differ
    monkeypatch.setattr(quantize_floor, "gemm_gflops", lambda *shape, dtype=torch.float32: rates[dtype])
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4)
    gflop = quantize_floor.phase_gflop(config, 1024, 256)
    fp32 = quantize_floor.floor_seconds(config, 1024, 256)
    bf16 = quantize_floor.floor_seconds(config, 1024, 256, math_dtype="bfloat16")
    assert fp32["floor_s"] == round(sum(gflop.values()) / 0.01, 1)
    rest = sum(v for k, v in gflop.items() if k in quantize_floor.FP32_PHASES)
    assert set(gflop) - set(quantize_floor.FP32_PHASES) == {"statistics_forward"}
    assert bf16["floor_s"] == round(gflop["statistics_forward"] / 0.04 + rest / 0.01, 1)
    assert bf16["floor_s"] < fp32["floor_s"]
    assert (fp32["math_dtype"], bf16["math_dtype"]) == ("float32", "bfloat16")
    assert (
        quantize_floor.rates_cell({"fp32_gflops": 100.0, "math_dtype": "bfloat16", "math_gflops": 400.0})
        == "100.0 / 400.0 bfloat16"
    )
    assert quantize_floor.rates_cell({"fp32_gflops": 100.0}) == "100.0"  # reports written before the math rate
