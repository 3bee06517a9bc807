"""The Triton W8A8 kernels (quantize, GEMM, split-K reduce), run on CPU in Triton's interpreter (TRITON_INTERPRET=1).

Triton reads TRITON_INTERPRET when it is first imported; tests/conftest.py sets it on machines
without CUDA, so these tests (and the "triton" cases of tests/test_ops_backends.py) run in-process.
"""

from __future__ import annotations

import os

import pytest
import torch

from quasar_hf.ops.reference import quantize_per_token, quantize_weight_per_channel, w8a8_linear_reference
from tests.helpers.triton_aot import hopper_ptx, run_outside_the_interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it when there is no CUDA)"
)


def layer(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(n, k, generator=g))
    return w_q, w_scale, torch.randn(n, generator=g)


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3


@in_interpreter
@pytest.mark.parametrize("m,k,n", [(1, 40, 24), (3, 70, 37), (16, 64, 48), (19, 33, 17)])
def test_triton_accumulators_are_exact(m, k, n):
    """The kernel's int32 accumulators equal the reference's, with K, N off the block grid."""
    from quasar_hf.ops.triton_w8a8 import w8a8_accumulators_triton

    w_q, _, _ = layer(n, k)
    x = activations(m, k)
    x[0, : k // 2] = 0.0
    a_q, _ = quantize_per_token(x)
    expected = (a_q.long() @ w_q.long().t()).to(torch.int32)
    assert torch.equal(w8a8_accumulators_triton(x, w_q), expected)


@in_interpreter
def test_triton_accumulators_with_prescale_and_ties():
    """Prescaled rows and exact .5 ties (floor(v + 0.5), not half-to-even) are quantized as the reference."""
    from quasar_hf.ops.triton_w8a8 import w8a8_accumulators_triton

    w_q, _, _ = layer(20, 12)
    x = torch.tensor([[127.0, 0.5, -1.5, 2.5, -2.5, 10.5, -0.5, 3.0, 0.0, 1.0, -126.5, 7.5]])
    eye_prescale = torch.ones(12)
    a_q, _ = quantize_per_token(x)
    assert torch.equal(w8a8_accumulators_triton(x, w_q, eye_prescale), (a_q.long() @ w_q.long().t()).int())
    prescale = torch.linspace(0.5, 2.0, 12)
    a_q, _ = quantize_per_token(x * prescale)
    assert torch.equal(w8a8_accumulators_triton(x, w_q, prescale), (a_q.long() @ w_q.long().t()).int())


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_outputs_bit_identical(dtype):
    from quasar_hf.ops.triton_w8a8 import w8a8_linear_triton

    w_q, w_scale, bias = layer(37, 70)
    x = activations(5, 70).to(dtype)
    y = w8a8_linear_triton(x, w_q, w_scale, bias.to(dtype))
    assert y.dtype == dtype
    assert torch.equal(y, w8a8_linear_reference(x, w_q, w_scale, bias.to(dtype)))


@in_interpreter
def test_triton_launch_configs_cover_decode_and_prefill(monkeypatch):
    """The CUDA heuristics: decode rows fill about 2 programs per SM by splitting K (as a function of N
    and K only), prefill takes 64/128-row tiles of the fused kernel."""
    import triton

    from quasar_hf.ops import triton_w8a8

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # ask for the GPU configs (read at call time)
    for n, k in ((1024, 4096), (4096, 4096), (12288, 4096), (4096, 12288)):
        for m in (1, 16):
            cfg = triton_w8a8.launch_config(m, n, k, sms=132)  # an H100 / H200
            programs = triton.cdiv(n, cfg["BLOCK_N"]) * cfg["SPLITS"]
            assert programs >= triton_w8a8.PROGRAMS_PER_SM * 132 // 2 and cfg["K_SPLIT"] % cfg["BLOCK_K"] == 0, (n, k, cfg)
            assert (cfg["SPLITS"] - 1) * cfg["K_SPLIT"] < k <= cfg["SPLITS"] * cfg["K_SPLIT"], "no empty split"
            assert cfg == triton_w8a8.launch_config(1, n, k, sms=132), "the split depends on N and K only"
        assert triton_w8a8.launch_config(1, n, k, sms=66)["SPLITS"] <= cfg["SPLITS"], "fewer SMs, no more splits"
    for m, rows in ((17, 64), (64, 64), (512, 128)):
        cfg = triton_w8a8.launch_config(m, 4096, 4096, sms=132)
        assert cfg["BLOCK_M"] == rows and cfg["SPLITS"] == 1


@in_interpreter
@pytest.mark.parametrize("k,n", [(70, 37), (200, 48), (33, 17)])
def test_decode_rows_are_the_same_bits_whatever_m_and_the_split(k, n):
    """Each row of a 1..16-row call equals that row alone and the reference, bit for bit, with several K
    splits (the interpreter's tiles: 16 columns, 32-wide K blocks), ragged K and N, bias and prescale."""
    from quasar_hf.ops.triton_w8a8 import launch_config, w8a8_linear_triton

    assert launch_config(1, n, k, sms=1)["SPLITS"] > 1
    w_q, w_scale, bias = layer(n, k, seed=3)
    prescale = torch.linspace(0.5, 2.0, k)
    x = activations(16, k, seed=4).to(torch.bfloat16)
    x[2, 5] = float("nan")  # a row with NaN gives NaN; its neighbours are untouched
    x[3] = 0.0
    for m in (1, 6, 16):
        together = w8a8_linear_triton(x[:m], w_q, w_scale, bias.bfloat16(), prescale)
        reference = w8a8_linear_reference(x[:m], w_q, w_scale, bias.bfloat16(), prescale)
        same = together.isnan() == reference.isnan()
        assert bool(same.all()) and torch.equal(together.nan_to_num(), reference.nan_to_num())
        for i in range(m):
            alone = w8a8_linear_triton(x[i : i + 1], w_q, w_scale, bias.bfloat16(), prescale)
            assert torch.equal(alone.nan_to_num(), together[i : i + 1].nan_to_num()), (m, i)


def test_triton_kernels_compile_for_hopper_with_exact_arithmetic():
    """Ahead-of-time builds for sm_90 (no GPU needed): int8 tensor-core MMA in the GEMM, IEEE division and
    square root in the quantizer, no FMA contraction anywhere. These are what the GPU bit-exactness with
    the reference relies on; the interpreter cannot show them (an interpreted session runs this in a child)."""
    if run_outside_the_interpreter(__file__, "test_triton_kernels_compile_for_hopper_with_exact_arithmetic"):
        return
    pytest.importorskip("triton", reason="triton is not installed")
    from quasar_hf.ops import triton_w8a8

    quantize, gemm, reduce = triton_w8a8.jitted_kernels(False)
    ints = lambda *names: dict.fromkeys(names, "i32")  # noqa: E731
    builds = {
        "quantize": (
            quantize,
            {"x_ptr": "*bf16", "pre_ptr": "*fp32", "q_ptr": "*i8", "scale_ptr": "*fp32", "r_ptr": "*fp32",
             **ints("K", "stride_xm"), "norm_eps": "fp32"},
            {"HAS_PRESCALE": True, "FOLD_NORM": True, "WRITE_R": False, "BLOCK_K": 1024},
        ),
        "gemm": (
            gemm,
            {"q_ptr": "*i8", "scale_ptr": "*fp32", "w_ptr": "*i8", "ws_ptr": "*fp32", "bias_ptr": "*bf16",
             "out_ptr": "*bf16", "part_ptr": "*i32", **ints("M", "N", "K", "K_SPLIT", "stride_wn", "stride_om")},
            {"HAS_BIAS": True, "ONE_SPLIT": True, "WRITE_ACC": False, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128},
        ),
        "reduce": (
            reduce,
            {"part_ptr": "*i32", "scale_ptr": "*fp32", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
             "acc_ptr": "*i32", **ints("M", "N", "SPLITS", "stride_om")},
            {"HAS_BIAS": True, "WRITE_ACC": False, "BLOCK_M": 16, "BLOCK_N": 256},
        ),
    }  # fmt: skip
    ptx = {name: hopper_ptx(*build) for name, build in builds.items()}
    for name, text in ptx.items():
        assert "fma.rn.f32" not in text, f"{name}: x * inv + 0.5 or the epilogue was contracted into an FMA"
    assert "mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32" in ptx["gemm"] or "wgmma" in ptx["gemm"]
    assert "div.rn.f32" in ptx["quantize"] and "div.full" not in ptx["quantize"] and "div.approx" not in ptx["quantize"]
    assert "sqrt.rn.f32" in ptx["quantize"] and "sqrt.approx" not in ptx["quantize"]  # the folded norm's 1 / sqrt(mean + eps)
