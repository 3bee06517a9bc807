"""The fused Triton W8A8 kernel, run on CPU in Triton's interpreter (TRITON_INTERPRET=1).

Triton reads TRITON_INTERPRET when it is first imported; tests/conftest.py sets it on machines
without CUDA, so these tests (and the "triton" cases of tests/test_ops_backends.py) run in-process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from quasar_hf.ops.reference import quantize_per_token, quantize_weight_per_channel, w8a8_linear_reference

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
def test_triton_launch_config_covers_decode_and_prefill(monkeypatch):
    """The CUDA tile heuristic: thin BLOCK_M=16 tiles for M <= 16, 64/128-row tiles for prefill."""
    from quasar_hf.ops import triton_w8a8

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # ask for the GPU configs (read at call time)
    decode = triton_w8a8._launch_config(1, 4096)
    prefill = triton_w8a8._launch_config(512, 4096)
    assert decode["BLOCK_M"] == 16 and prefill["BLOCK_M"] == 128
    assert all(cfg[key] >= 16 for cfg in (decode, prefill) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))


def test_triton_kernel_compiles_for_hopper_with_exact_arithmetic():
    """Ahead-of-time build for sm_90 (no GPU needed): int8 tensor-core MMA, IEEE division, no FMA contraction.

    These are what the GPU bit-exactness with the reference relies on; the interpreter cannot show
    them, so an interpreted session runs this test in a child process with TRITON_INTERPRET=0.
    """
    if INTERPRETED:
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        test_id = f"{__file__}::test_triton_kernel_compiles_for_hopper_with_exact_arithmetic"
        child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_id],
                               env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert child.returncode == 0 and " passed" in child.stdout, child.stdout[-4000:] + child.stderr[-2000:]
        return
    triton = pytest.importorskip("triton", reason="triton is not installed")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as err:
        pytest.skip(f"this triton has no ahead-of-time compile API: {err}")
    from quasar_hf.ops import triton_w8a8

    kernel = triton_w8a8._jitted_kernel(False)
    pointers = {"x_ptr": "*bf16", "w_ptr": "*i8", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "pre_ptr": "*fp32",
                "out_ptr": "*bf16", "acc_ptr": "*i32", "r_ptr": "*fp32"}  # fmt: skip
    scalars = {**dict.fromkeys(["M", "N", "K", "stride_xm", "stride_wn", "stride_om"], "i32"), "norm_eps": "fp32"}
    constants = {"HAS_BIAS": True, "HAS_PRESCALE": True, "WRITE_ACC": False, "FOLD_NORM": True,
                 "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256}  # fmt: skip
    signature = {**pointers, **scalars, **dict.fromkeys(constants, "constexpr")}
    try:
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constants),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4, "enable_fp_fusion": False},
        )
    except (TypeError, KeyError) as err:  # signature format of another triton release
        pytest.skip(f"this triton's ahead-of-time compile API differs: {err!r}")
    ptx = compiled.asm["ptx"]
    assert "mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32" in ptx or "wgmma" in ptx
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "sqrt.rn.f32" in ptx and "sqrt.approx" not in ptx  # the folded norm's 1 / sqrt(mean + eps)
    assert "fma.rn.f32" not in ptx, "x * inv + 0.5 or the epilogue was contracted into an FMA"
