"""Every build of every C kernel computes the same bits, on whichever CPU runs the tests.

The C++ library links every build of csrc/kernel_builds.def and picks, per kernel, the best one the
CPU runs. `$QUASAR_HF_CPU_FLAGS_OFF` makes a subprocess pick as a CPU without some flags would: the
AVX2 builds on a machine with AVX-512, the portable builds (and no W8A8 or row-stable linear kernel:
their plain-PyTorch fallbacks) on one with AVX2. Each run checks the exact kernels against their
oracles bit for bit and saves the attention outputs, which every run must reproduce exactly.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from quasar_hf.ops import native
from quasar_hf.ops.c_build import MASK_ENV, missing_cpu_flags
from quasar_hf.ops.reference import sqrt_correctly_rounded

requires_native = pytest.mark.kernels()

RUN = textwrap.dedent(
    """
    import sys
    import torch
    from quasar_hf.ops import attention_cpu, cpu_fused, hadamard_cpu, native, rowstable_linear
    from quasar_hf.ops.dispatch import resolve_backend
    from quasar_hf.ops.hadamard import HadamardRotation, rotate_rows_reference
    from quasar_hf.ops.reference import (
        int8_matmul_reference, quantize_per_token, rowstable_linear_reference, rowstable_rms_norm_reference,
        w8a8_linear_reference, w8a8_linear_rmsnorm_reference,
    )

    print("builds", sorted(f"{k}={b}" for k, (b, _) in native.kernel_builds().items()))
    print("w8a8", cpu_fused.unavailable_reason())
    print("lm_head", rowstable_linear.unavailable_reason())
    print("auto", resolve_backend("auto", "cpu"))
    if not cpu_fused.is_available():
        try:
            cpu_fused.w8a8_linear_cpu_fused(torch.ones(1, 8), torch.ones(4, 8, dtype=torch.int8), torch.ones(4))
        except RuntimeError as err:
            print("refused", err)
    gen = torch.Generator().manual_seed(0)

    # W8A8: M = 1, ragged K and N, 3 row blocks; a zero row; -128 weights (the AVX2 sign trick)
    for m, k, n in ((1, 37, 5), (6, 100, 37), (7, 576, 64), (13, 4, 16)):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
            x[m // 2] = 0
            w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
            s, b = torch.rand(n, generator=gen) / 100, torch.randn(n, generator=gen).to(dtype)
            if cpu_fused.is_available():
                assert torch.equal(cpu_fused.w8a8_linear_cpu_fused(x, w, s, b), w8a8_linear_reference(x, w, s, b)), (m, k, n, dtype)
                acc = int8_matmul_reference(quantize_per_token(x)[0], w)
                assert torch.equal(cpu_fused.int8_accumulators_cpu_fused(x, w), acc), "exact int32 accumulators"
            packed = cpu_fused.pack_weight(w)  # the op itself: C++ where the kernel runs, else its fallback
            y = torch.ops.quasar.w8a8_linear_cpu_packed(x, packed.data, packed.wsum128, s, b, None, n)
            assert torch.equal(y, w8a8_linear_reference(x, w, s, b)), ("op", m, k, n, dtype)
    # an RMSNorm folded into the linear's quantization (one call): ragged K and N, M = 1, a zero row
    for m, k, n in ((1, 37, 37), (7, 576, 256), (64, 576, 100)):
        xq = torch.randn(m, k, generator=gen) * 3
        xq[m // 2] = 0
        wq, sq = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen) / 100
        scale_q, pq = torch.rand(k, generator=gen) + 0.5, cpu_fused.pack_weight(wq)
        y = torch.ops.quasar.w8a8_folded_norm_linear_cpu_packed(xq.bfloat16(), scale_q, 1e-5, pq.data, pq.wsum128, sq, None, n)
        assert torch.equal(y, w8a8_linear_rmsnorm_reference(xq.bfloat16(), scale_q, 1e-5, wq, sq)), ("folded", m, k, n)
    # the row-stable linear: long rows too (smaller row groups, several weight chunks); M = 1 is row 0
    for m, k, n in ((1, 37, 5), (6, 100, 37), (7, 576, 64), (13, 4, 16), (7, 2050, 70), (3, 8200, 13)):
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
            b = torch.randn(n, generator=gen).to(dtype)
            y = torch.ops.quasar.rowstable_linear(x, w, b)
            assert torch.equal(y, rowstable_linear_reference(x, w, b)), (m, k, n, dtype)
            assert torch.equal(torch.ops.quasar.rowstable_linear(x[:1], w, b), y[:1]), "row-stable"
    # the Hadamard rotation: every kind of width, decode, verify and a threaded calibration-sized call
    for width in (1, 2, 3, 6, 12, 20, 24, 28, 96, 100, 576, 640, 896, 1536, 2048, 4864):
        rotation = HadamardRotation.for_size(width)
        for rows in (1, 6, 70):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, width, generator=gen).to(dtype)
                assert torch.equal(hadamard_cpu.rotate_rows(x, rotation), rotate_rows_reference(x, rotation)), (width, rows)
    # the RMSNorm: both formulas, a width that is not a multiple of 8
    for dtype, offset, in_float in ((torch.bfloat16, 0.0, False), (torch.float32, 1.0, True)):
        x, w = (torch.randn(5, 77, generator=gen) * 3).to(dtype), torch.randn(77, generator=gen).to(dtype)
        assert torch.equal(torch.ops.quasar.rms_norm(x, w, 1e-6, offset, in_float), rowstable_rms_norm_reference(x, w, 1e-6, offset, in_float))
    print("exact")

    # attention: decode, verification, GQA, MHA, ragged head sizes; a peaked softmax and NaNs
    outputs = []
    for batch, heads, kv_heads, q_len, kv_len, dim in (
        (1, 9, 3, 1, 40, 64), (1, 9, 3, 6, 300, 64), (2, 4, 2, 5, 37, 20), (1, 2, 2, 3, 3, 72), (3, 6, 1, 17, 50, 16),
        (1, 4, 1, 3, 33, 128), (1, 4, 1, 2, 20, 256), (1, 14, 2, 6, 50, 64), (2, 8, 2, 3, 45, 64),
    ):
        for dtype in (torch.float32, torch.bfloat16):
            q = (torch.randn(batch, heads, q_len, dim, generator=gen) * 2).to(dtype)
            k, v = (torch.randn(batch, kv_heads, kv_len, dim, generator=gen).to(dtype) for _ in range(2))
            visible = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
            visible = visible[None] & ~(torch.rand(batch, q_len, kv_len, generator=gen) < 0.3)
            visible[:, :, 0] = True
            outputs += [torch.ops.quasar.rowstable_attention(q, k, v, visible, None), torch.ops.quasar.rowstable_attention(q, k, v, None, None)]
    q, k, v = (torch.randn(1, h, n, 64, generator=gen) for h, n in ((2, 1), (2, 40), (2, 40)))
    q[0, 1, 0, 5] = float("nan")
    outputs += [torch.ops.quasar.rowstable_attention(q, k, v, None, scale) for scale in (None, 60.0)]
    q, k, v = (torch.randn(1, h, n, 64, generator=gen) for h, n in ((6, 2), (2, 40), (2, 40)))
    k[0, 1, 21, 3] = float("nan")
    outputs.append(torch.ops.quasar.rowstable_attention(q, k, v, None, None))
    torch.save(outputs, sys.argv[1])
    """
)

PREFILL_RUN = textwrap.dedent(
    """
    import sys
    import torch
    from quasar_hf.ops import attention_cpu, native

    print("prefill", native.kernel_builds().get("prefill_attention", ("none",))[0])
    gen = torch.Generator().manual_seed(0)
    outputs = []  # the prompt kernel's, where a build runs (saved to the last argument)
    # ragged lengths (16-row query blocks, 64-key blocks), GQA groups of 1-7, head sizes 32-256
    for batch, heads, kv_heads, length, dim in (
        (1, 9, 3, 65, 64), (2, 4, 2, 130, 96), (1, 7, 1, 200, 32), (1, 4, 4, 257, 256), (1, 6, 3, 300, 128),
        (1, 2, 1, 77, 160), (1, 14, 2, 100, 224),
    ) if attention_cpu.prefill_unavailable_reason() is None else ():
        q = (torch.randn(batch, length, heads, dim, generator=gen) * 2).bfloat16().transpose(1, 2)
        k, v = (torch.randn(batch, length, kv_heads, dim, generator=gen).bfloat16().transpose(1, 2) for _ in range(2))
        outputs.append(attention_cpu.prefill_attention(q, k, v, dim**-0.5))
        # tiny values: q.k products below FLT_MIN, outputs below it, denormal bf16 queries (flushed alike)
        tiny_q = q * 1e-20
        tiny_q[..., ::5] = 3e-39
        outputs.append(attention_cpu.prefill_attention(tiny_q, k * 1e-19, v * 1e-37, 1.0))
        # continuations over earlier keys (the queries the last Q of N positions): one row, and most rows
        for start in (length - 1, length // 3):
            outputs.append(attention_cpu.prefill_attention(q[:, :, start:], k, v, dim**-0.5))
    torch.save(outputs, sys.argv[-1])
    """
)
AVX512_OFF = "avx512f,avx512bw,avx512vl,avx512dq,avx512_vnni"
PORTABLE = f"avx2,fma,f16c,{AVX512_OFF}"
# the prompt kernel's builds, best first, and the flags that make each the best one left
PREFILL_BUILDS = (("avx512bf16", ""), ("avx512", "avx512_bf16"), ("avx2", AVX512_OFF))


@functools.cache
def run_masked(flags: str, folder: str, script: str = RUN + PREFILL_RUN) -> tuple[str, list[torch.Tensor], list[torch.Tensor]]:
    """The scripts' printout, attention outputs (RUN's) and prompt kernel outputs (PREFILL_RUN's, none where
    no build runs) in a process that treats `flags` as absent."""
    paths = [os.path.join(folder, f"{kind}_{flags or 'none'}.pt") for kind in ("attention", "prefill")]
    env = {**os.environ, MASK_ENV: flags}
    done = subprocess.run([sys.executable, "-c", script, *paths], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, torch.load(paths[0]) if script != PREFILL_RUN else [], torch.load(paths[1])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("builds"))


def masks() -> list:
    """The masks that change a build on this CPU: none, no AVX-512, no AVX2 (the portable builds)."""
    cases = [pytest.param("", id="best")]
    if not missing_cpu_flags(("avx512f",)):
        cases.append(pytest.param(AVX512_OFF, id="avx2"))
    if not missing_cpu_flags(("avx2",)):
        cases.append(pytest.param(PORTABLE, id="portable"))
    return cases


@requires_native
@pytest.mark.parametrize("flags", masks())
def test_every_build_computes_the_oracle_bits_and_the_same_attention(flags, folder):
    out, attention, _ = run_masked(flags, folder)
    assert "exact" in out, out
    _, best, _ = run_masked("", folder)
    assert len(attention) == len(best)
    for got, expected in zip(attention, best):
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
    nan_query, nan_key = best[-3], best[-1]  # a NaN in one query row; one NaN key of kv head 1 (heads 3-5)
    assert bool(nan_query[0, 0, 1].isnan().all()) and not bool(nan_query[0, 0, 0].isnan().any())
    assert bool(nan_key[0, :, 3:].isnan().all()) and not bool(nan_key[0, :, :3].isnan().any())


@requires_native
@pytest.mark.skipif(bool(missing_cpu_flags(("avx512f",))), reason="needs AVX-512 to mask it")
def test_without_avx512_the_avx2_builds_run(folder):
    out, _, _ = run_masked(AVX512_OFF, folder)
    assert "'w8a8=avx2'" in out and "'attention=avx2'" in out and "w8a8 None" in out and "auto cpu_fused" in out, out
    assert "'prefill_attention=avx2'" in out, out


@requires_native
@pytest.mark.skipif(bool(missing_cpu_flags(("avx2",))), reason="needs AVX2 to mask it")
def test_without_avx2_the_portable_builds_run_and_the_reasons_say_why(folder):
    out, _, _ = run_masked(PORTABLE, folder)
    assert "['attention=portable', 'hadamard=portable', 'rms_norm=portable']" in out, out
    assert "w8a8 no build of the fused W8A8 linear kernel runs on this CPU (needs avx512f" in out and "avx2 + f16c)" in out, out
    assert "lm_head no build of the row-stable linear kernel runs on this CPU" in out and "auto torch" in out, out
    assert "refused the fused CPU W8A8 kernel is unavailable: no build" in out and "use the 'torch' backend" in out, out


def test_the_build_table_names_sources_that_exist_and_compiles_each_once():
    table = native.kernel_build_table()
    assert {row.kernel for row in table} == set(native.kernel_titles())
    assert all((native.CSRC / row.source).is_file() for row in table)
    assert len({(row.kernel, row.build) for row in table}) == len(table)
    units = native.compile_units()
    assert [u.source for u in units[-2:]] == ["cpu_kernels.cpp", "native_ops.cpp"]


def test_the_oracle_sqrt_is_correctly_rounded_for_every_fp32_in_one_binade_pair():
    """Exhaustive over [1, 4) (every mantissa, both exponent parities: sqrt's rounding repeats with
    period 4), against numpy's fp32 sqrt (the IEEE instruction); torch.sqrt need not pass this."""
    import numpy as np

    values = torch.arange(0x3F800000, 0x40800000, dtype=torch.int32).view(torch.float32)
    assert torch.equal(sqrt_correctly_rounded(values), torch.from_numpy(np.sqrt(values.numpy())))


def test_cxx_standard_follows_torch_headers():
    """torch 2.14's headers use C++20 `requires`: built as C++17 every op fell back to torch."""
    from quasar_hf.ops.native import cxx_standard

    assert cxx_standard("2.11.0+cu130") == "c++17" and cxx_standard("2.13.0+cpu") == "c++17"
    assert cxx_standard("2.14.1+cu130") == "c++20" and cxx_standard("3.0.0") == "c++20"


def prefill_builds_here() -> list:
    """Each build of the prompt kernel this CPU runs, with flags that make it the one chosen."""
    table = {row.build: row.cpu_flags for row in native.kernel_build_table() if row.kernel == "prefill_attention"}
    return [pytest.param(build, flags, id=build) for build, flags in PREFILL_BUILDS if not missing_cpu_flags(table[build])]


@requires_native
@pytest.mark.parametrize(("build", "flags"), prefill_builds_here())
def test_every_build_of_the_prompt_kernel_computes_the_same_bits(build, flags, folder):
    """vdpbf16ps's products as fp32 FMAs in its order, with denormals flushed as it flushes them: the
    AVX-512F and AVX2 builds give the AVX512-BF16 build's bits, tiny and denormal inputs and continuations
    over earlier keys (fewer queries than keys) included."""
    alone = flags not in ("", AVX512_OFF)  # the other runs' script includes the prompt kernel's part
    out, _, outputs = run_masked(flags, folder, PREFILL_RUN) if alone else run_masked(flags, folder)
    assert f"prefill {build}" in out, out
    _, _, best = run_masked(prefill_builds_here()[0].values[1], folder)
    assert len(outputs) == len(best) == 28
    for got, expected in zip(outputs, best):
        assert torch.equal(got, expected)
    tiny = outputs[1::4]  # per shape: the prompt, its tiny values, two continuations
    assert all(bool((t == 0).any()) and bool((t != 0).any()) for t in tiny)  # outputs flushed, and outputs kept
