"""Every build of every C kernel computes the oracle's bits, on whichever x86-64 CPU runs the tests.

The W8A8 and row-stable linear kernels have an AVX-512 build and an AVX2 build (`VARIANTS`); the
process picks the best one the CPU has. Here each variant this CPU can run is checked against the
oracle directly, and `$QUASAR_HF_CPU_FLAGS_OFF` runs a subprocess as a CPU without AVX-512 (the
AVX2 builds, on a machine that has AVX-512) or without AVX2 (no kernels: the fallbacks).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from quasar_hf.ops import cpu_fused, rowstable_linear
from quasar_hf.ops.c_build import MASK_ENV, missing_cpu_flags
from quasar_hf.ops.reference import (
    int8_matmul_reference,
    quantize_per_token,
    rowstable_linear_reference,
    sqrt_correctly_rounded,
    w8a8_linear_reference,
)

SHAPES = [(1, 37, 5), (6, 100, 37), (7, 576, 64), (13, 4, 16)]  # (M, K, N): M = 1, ragged K and N, 3 row blocks
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The row-stable linear also tiles by K: long rows make smaller row groups and several weight chunks.
ROWSTABLE_SHAPES = [*SHAPES, (7, 2050, 70), (3, 8200, 13)]


def runnable(variants) -> list:
    return [pytest.param(v, id=v[0]) for v in variants if not missing_cpu_flags(v[2])]


def w8a8_case(m: int, k: int, n: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    if m > 2:
        x[1] = 0  # a zero row: scale 0, output = bias
    weight_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)  # -128 too: the AVX2 sign trick must hold
    return x, weight_q, torch.rand(n, generator=gen) / 100, torch.randn(n, generator=gen).to(dtype)


@pytest.mark.parametrize("variant", runnable(cpu_fused.VARIANTS))
def test_each_w8a8_build_equals_the_oracle_bit_for_bit(variant):
    library = cpu_fused.load_variant(variant[0], variant[1])
    assert library.fn is not None, library.error
    for index, (m, k, n) in enumerate(SHAPES):
        for dtype in DTYPES:
            x, weight_q, weight_scale, bias = w8a8_case(m, k, n, dtype, seed=index)
            packed = cpu_fused.pack_weight(weight_q)
            got = cpu_fused._call(library.fn, x, weight_q, weight_scale, bias, None, packed, want_output=True)
            assert torch.equal(got, w8a8_linear_reference(x, weight_q, weight_scale, bias)), (variant[0], m, k, n, dtype)
            acc = cpu_fused._call(library.fn, x, weight_q, weight_scale, None, None, packed, want_output=False)
            assert torch.equal(acc, int8_matmul_reference(quantize_per_token(x)[0], weight_q)), "exact int32 accumulators"


@pytest.mark.parametrize("variant", runnable(rowstable_linear.VARIANTS))
def test_each_rowstable_linear_build_equals_the_oracle_bit_for_bit(variant):
    fn, error = rowstable_linear.load_variant(variant[0], variant[1])
    assert fn is not None, error
    for index, (m, k, n) in enumerate(ROWSTABLE_SHAPES):
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(index)
            x, weight = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
            bias = torch.randn(n, generator=gen).to(dtype)
            got = rowstable_linear._run(fn, x, weight, bias)
            assert torch.equal(got, rowstable_linear_reference(x, weight, bias)), (variant[0], m, k, n, dtype)
            assert torch.equal(rowstable_linear._run(fn, x[:1], weight, bias), got[:1]), "row-stable: M = 1 equals row 0"


def test_the_oracle_sqrt_is_correctly_rounded_for_every_fp32_in_one_binade_pair():
    """Exhaustive over [1, 4) (every mantissa, both exponent parities: sqrt's rounding repeats with
    period 4), against numpy's fp32 sqrt (the IEEE instruction); torch.sqrt need not pass this."""
    import numpy as np

    values = torch.arange(0x3F800000, 0x40800000, dtype=torch.int32).view(torch.float32)
    assert torch.equal(sqrt_correctly_rounded(values), torch.from_numpy(np.sqrt(values.numpy())))


MASKED_RUN = textwrap.dedent(
    """
    import torch
    from quasar_hf.ops import cpu_fused, rowstable_linear
    from quasar_hf.ops.dispatch import resolve_backend
    from quasar_hf.ops.cpu_fused_multi import bind_linear_multi
    from quasar_hf.ops.reference import w8a8_linear_reference, w8a8_linear_rmsnorm_reference
    print("source", cpu_fused.kernel_source(), "reason", cpu_fused.unavailable_reason(), "lm_head", rowstable_linear.unavailable_reason())
    print("auto", resolve_backend("auto", "cpu"))
    if cpu_fused.is_available():
        torch.manual_seed(0)
        w = torch.randint(-127, 128, (256, 576), dtype=torch.int8); s = torch.rand(256) * 1e-3
        scale = torch.rand(576) + 0.5
        x = torch.randn(64, 576) * 3
        fused = bind_linear_multi([(w, s, None), (w, s, None)], scale, norm_eps=1e-5)(x)
        oracle = w8a8_linear_rmsnorm_reference(x, scale, 1e-5, w, s)
        assert all(torch.equal(y, oracle) for y in fused), "folded rows differ from the oracle"
        assert torch.equal(cpu_fused.w8a8_linear_cpu_fused(x.bfloat16(), w, s), w8a8_linear_reference(x.bfloat16(), w, s))
        print("exact")
    """
)


def run_masked(flags: str) -> str:
    env = {**os.environ, MASK_ENV: flags}
    done = subprocess.run([sys.executable, "-c", MASKED_RUN], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.skipif(bool(missing_cpu_flags(("avx2", "f16c"))), reason="needs an x86-64 CPU with AVX2")
def test_without_avx512_the_avx2_builds_run_and_fold_exactly():
    out = run_masked("avx512f,avx512_vnni")
    assert "source w8a8_avx2.c reason None lm_head None" in out and "auto cpu_fused" in out and "exact" in out, out


def test_without_avx2_no_kernel_runs_and_the_reasons_say_why():
    out = run_masked("avx2,avx512f,avx512_vnni")
    assert "source None reason this CPU lacks avx2" in out and "lm_head this CPU lacks avx2" in out, out
    assert "auto torch" in out and "exact" not in out, out
