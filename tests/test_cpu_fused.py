"""The fused AVX-512 VNNI W8A8 kernel against the reference oracle: exact int32 accumulators and
bit-identical outputs (NaN positions equal), plus input validation."""

from __future__ import annotations

import pytest
import torch

from quasar_hf.ops import cpu_fused, native
from quasar_hf.ops.reference import (
    int8_matmul_reference,
    quantize_per_token,
    quantize_weight_per_channel,
    w8a8_linear_reference,
)

requires_kernel = pytest.mark.kernels("w8a8")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype and shape, NaN in the same places, identical bits everywhere else."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), "NaN positions differ"
    int_view = torch.int32 if actual.dtype == torch.float32 else torch.int16
    diff = (actual.view(int_view) != expected.view(int_view)) & ~nan_e
    assert not diff.any(), (
        f"{int(diff.sum())} of {diff.numel()} outputs differ; max abs diff "
        f"{(actual.float() - expected.float())[diff].abs().max().item():.3e}"
    )


def random_case(m: int, k: int, n: int, dtype: torch.dtype, seed: int):
    """x [m, k] in dtype, quantized weight [n, k] + scales, fp32 bias [n]."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
    weight_q, weight_scale = quantize_weight_per_channel(torch.randn(n, k, generator=gen))
    bias = torch.randn(n, generator=gen)
    return x, weight_q, weight_scale, bias


SHAPES = [
    (1, 64, 16),
    (2, 577, 193),
    (4, 576, 192),
    (6, 1000, 1000),
    (9, 3, 5),
    (13, 130, 47),
    (16, 576, 1536),
    (17, 96, 64),
    (20, 193, 577),
]


@requires_kernel
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulators_are_exact(m, k, n, dtype):
    x, weight_q, _, _ = random_case(m, k, n, dtype, seed=m * 1000 + k + n)
    a_q, _ = quantize_per_token(x)
    expected = int8_matmul_reference(a_q, weight_q)
    assert torch.equal(cpu_fused.int8_accumulators_cpu_fused(x, weight_q), expected)


@requires_kernel
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_output_matches_reference_bitwise(m, k, n, dtype, with_bias):
    x, weight_q, weight_scale, bias = random_case(m, k, n, dtype, seed=m + k * 7 + n * 13)
    bias = bias if with_bias else None
    expected = w8a8_linear_reference(x, weight_q, weight_scale, bias)
    assert_bitwise_equal(cpu_fused.w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias), expected)


@requires_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_act_prescale_and_low_precision_bias(dtype):
    x, weight_q, weight_scale, bias = random_case(5, 577, 193, dtype, seed=3)
    prescale = torch.rand(577, generator=torch.Generator().manual_seed(4)) * 4 + 0.05
    bias = bias.to(dtype)
    expected = w8a8_linear_reference(x, weight_q, weight_scale, bias, act_prescale=prescale)
    actual = cpu_fused.w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias, act_prescale=prescale)
    assert_bitwise_equal(actual, expected)
    a_q, _ = quantize_per_token(x.float() * prescale)
    acc = cpu_fused.int8_accumulators_cpu_fused(x, weight_q, act_prescale=prescale)
    assert torch.equal(acc, int8_matmul_reference(a_q, weight_q))


@requires_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_rows_zero_nan_inf_huge(dtype):
    x, weight_q, weight_scale, bias = random_case(7, 200, 40, torch.float32, seed=5)
    big = torch.finfo(dtype).max
    x[1] = 0.0  # all-zero row -> exactly bias
    x[2, 17] = float("nan")  # NaN row -> NaN everywhere in that row
    x[3, 0] = float("inf")  # Inf row -> NaN
    x[4, 199] = -float("inf")
    x[5] = x[5].sign() * big  # huge finite values: the scale absorbs them
    x[6, :100] = big / 2  # mixed magnitudes
    x = x.to(dtype)
    expected = w8a8_linear_reference(x, weight_q, weight_scale, bias)
    actual = cpu_fused.w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias)
    assert_bitwise_equal(actual, expected)
    assert torch.equal(actual[1], bias.to(dtype)) and torch.isnan(actual[2:5]).all()
    a_q, _ = quantize_per_token(x)
    assert torch.equal(cpu_fused.int8_accumulators_cpu_fused(x, weight_q), int8_matmul_reference(a_q, weight_q))


@requires_kernel
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_subnormal_rows_match_reference(dtype):
    """amax below 2**-126: 127 / amax overflows to inf, and zeros in the row hit 0 * inf = NaN."""
    x, weight_q, weight_scale, bias = random_case(3, 70, 24, torch.float32, seed=11)
    x[0] = x[0] * 1e-40
    x[1, ::2] = 0.0
    x[1] = x[1] * 1e-41
    x = x.to(dtype)
    a_q, _ = quantize_per_token(x)
    assert torch.equal(cpu_fused.int8_accumulators_cpu_fused(x, weight_q), int8_matmul_reference(a_q, weight_q))
    assert_bitwise_equal(
        cpu_fused.w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias), w8a8_linear_reference(x, weight_q, weight_scale, bias)
    )


@requires_kernel
def test_extreme_weights_and_activations_stay_exact():
    """All +-127 weights and activations: the largest accumulators the int8 range allows."""
    k, n = 4099, 33
    weight_q = torch.full((n, k), 127, dtype=torch.int8)
    weight_q[::2] = -127
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    a_q, _ = quantize_per_token(x)
    assert torch.equal(cpu_fused.int8_accumulators_cpu_fused(x, weight_q), int8_matmul_reference(a_q, weight_q))


@requires_kernel
def test_3d_input_noncontiguous_input_and_packed_weight_agree():
    x, weight_q, weight_scale, bias = random_case(2 * 3, 96, 80, torch.bfloat16, seed=6)
    x3 = x.reshape(2, 3, 96)
    expected = w8a8_linear_reference(x3, weight_q, weight_scale, bias)
    packed = cpu_fused.pack_weight(weight_q)
    actual = cpu_fused.w8a8_linear_cpu_fused(x3, weight_q, weight_scale, bias, packed=packed)
    assert actual.shape == (2, 3, 80)
    assert_bitwise_equal(actual, expected)
    x_wide = torch.cat([x, torch.full((6, 5), float("nan"), dtype=x.dtype)], dim=1)[:, :96]  # row stride 101
    assert x_wide.stride() == (101, 1)
    assert_bitwise_equal(
        cpu_fused.w8a8_linear_cpu_fused(x_wide, weight_q, weight_scale, bias, packed=packed),
        w8a8_linear_reference(x, weight_q, weight_scale, bias),
    )
    x_t = x.t().contiguous().t()  # same values, column-major storage
    assert not x_t.is_contiguous()
    assert_bitwise_equal(
        cpu_fused.w8a8_linear_cpu_fused(x_t, weight_q, weight_scale, bias), w8a8_linear_reference(x, weight_q, weight_scale, bias)
    )


@requires_kernel
def test_thread_count_does_not_change_results():
    # 1040 x 640 int8 weight = 650 KiB: above the kernel's per-thread minimum, so 2 threads split it
    x, weight_q, weight_scale, bias = random_case(9, 640, 1040, torch.float32, seed=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_fused.w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias)
        torch.set_num_threads(max(2, before))
        multi = cpu_fused.w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias)
    finally:
        torch.set_num_threads(before)
    assert_bitwise_equal(multi, single)
    assert_bitwise_equal(single, w8a8_linear_reference(x, weight_q, weight_scale, bias))


@requires_kernel
def test_empty_batch_returns_empty_output():
    _, weight_q, weight_scale, _ = random_case(1, 32, 16, torch.float32, seed=8)
    out = cpu_fused.w8a8_linear_cpu_fused(torch.empty(0, 32, dtype=torch.bfloat16), weight_q, weight_scale)
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16


def test_pack_weight_layout_roundtrips():
    _, weight_q, _, _ = random_case(1, 10, 20, torch.float32, seed=9)
    packed = cpu_fused.pack_weight(weight_q)
    assert packed.data.shape == (2, 3, 16, 4)  # N 20 -> 32, K 10 -> 12
    unpacked = packed.data.permute(0, 2, 1, 3).reshape(32, 12)
    assert torch.equal(unpacked[:20, :10], weight_q) and not unpacked[20:].any() and not unpacked[:, 10:].any()
    assert torch.equal(cpu_fused.unpack_weight(packed.data, 20, 10), weight_q)
    assert torch.equal(packed.wsum128[:20], weight_q.int().sum(dim=1) * 128)


def test_bad_inputs_raise_clear_errors():
    x, weight_q, weight_scale, bias = random_case(2, 32, 16, torch.float32, seed=10)
    with pytest.raises(TypeError, match="x must be"):
        cpu_fused.w8a8_linear_cpu_fused(x.double(), weight_q, weight_scale)
    with pytest.raises(TypeError, match="weight_q must be an int8"):
        cpu_fused.w8a8_linear_cpu_fused(x, weight_q.float(), weight_scale)
    with pytest.raises(ValueError, match="input features"):
        cpu_fused.w8a8_linear_cpu_fused(x[:, :31], weight_q, weight_scale)
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        cpu_fused.w8a8_linear_cpu_fused(x, weight_q, weight_scale[:15])
    with pytest.raises(TypeError, match="weight_scale must be float32"):
        cpu_fused.w8a8_linear_cpu_fused(x, weight_q, weight_scale.double())
    with pytest.raises(ValueError, match="bias must be"):
        cpu_fused.w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias[:3])
    with pytest.raises(ValueError, match="act_prescale must have shape"):
        cpu_fused.w8a8_linear_cpu_fused(x, weight_q, weight_scale, act_prescale=torch.ones(5))
    other = cpu_fused.pack_weight(weight_q[:8])
    with pytest.raises(ValueError, match="re-run pack_weight"):
        cpu_fused.w8a8_linear_cpu_fused(x, weight_q, weight_scale, packed=other)
    with pytest.raises(TypeError, match="pack_weight expects an int8"):
        cpu_fused.pack_weight(weight_q.float())


def test_smoke_test_rejects_a_kernel_that_computes_wrong_values():
    from quasar_hf.ops.torch_ops import OPS

    (op,) = [op for op in OPS if op.name == "w8a8_linear_cpu_packed"]
    zeros = lambda *args: torch.zeros_like(torch.ops.quasar.w8a8_linear_cpu_packed(*args))  # noqa: E731
    assert "disagrees with its reference" in native._smoke_test(op, zeros)
    assert native._smoke_test(op, torch.ops.quasar.w8a8_linear_cpu_packed) is None
