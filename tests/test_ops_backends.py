"""Every W8A8 backend against the reference (ops/reference.py), edge cases included.

Exact backends ("torch", "cpu_fused", and "triton" in Triton's CPU interpreter) must match the
reference bit for bit (NaN where it has NaN); "bitsandbytes" rounds ties differently, so it gets
an error bound derived from its own int8 values (see test_bitsandbytes_error_is_explained).

"triton" joins the parametrization when TRITON_INTERPRET=1 was set before Triton was imported
(tests/conftest.py does so on machines without CUDA).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from quasar_hf.ops import dispatch
from quasar_hf.ops.reference import quantize_per_token, quantize_weight_per_channel, w8a8_linear_reference
from tests.helpers.kernels import require_kernels

TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
EXACT_BACKENDS = ["torch", "cpu_fused", *(["triton"] if TRITON_INTERPRETED else [])]
ALL_BACKENDS = ["reference", *EXACT_BACKENDS, "bitsandbytes"]


@pytest.fixture
def backend(request) -> str:
    """A backend name, skipped (with the reason dispatch gives) when it cannot run on this CPU."""
    name = request.param
    if name == "cpu_fused":
        require_kernels("w8a8")
    reason = dispatch._unavailable_reason(name, "cpu")
    if reason is not None:
        pytest.skip(f"{name} unavailable on this machine: {reason}")
    return name


def make_layer(n: int, k: int, seed: int = 0, with_bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w_q, w_scale = quantize_weight_per_channel(w)
    bias = torch.randn(n, generator=g) if with_bias else None
    return w_q, w_scale, bias


def make_x(shape, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 3).to(dtype)


def assert_matches_reference(y: torch.Tensor, ref: torch.Tensor, backend: str) -> None:
    """Bit-identical (NaN == NaN) for exact backends; a tight relative bound for bitsandbytes."""
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert torch.equal(torch.isnan(y), torch.isnan(ref)), "NaN rows differ from the reference"
    finite = ~torch.isnan(ref)
    if backend == "bitsandbytes":
        err = (y.float() - ref.float())[finite].abs()
        scale = ref.float()[finite].abs().max().clamp_min(1e-6)
        assert (err / scale).max() < 0.02, f"bitsandbytes relative error {(err / scale).max():.4f}"
    else:
        assert torch.equal(y[finite], ref[finite]), f"{backend} differs from the reference"


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("m", [1, 2, 5, 16, 17])
def test_ragged_shapes_match_reference(backend, m):
    w_q, w_scale, bias = make_layer(n=37, k=70)  # K, N not multiples of any block size
    x = make_x((m, 70))
    ref = w8a8_linear_reference(x, w_q, w_scale, bias)
    assert_matches_reference(dispatch.w8a8_linear(x, w_q, w_scale, bias, backend=backend), ref, backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_3d_input(backend, dtype):
    w_q, w_scale, bias = make_layer(n=48, k=64)
    x = make_x((2, 3, 64), dtype)  # [B, T, K]
    y = dispatch.w8a8_linear(x, w_q, w_scale, bias.to(dtype), backend=backend)
    assert y.shape == (2, 3, 48) and y.dtype == dtype
    assert_matches_reference(y, w8a8_linear_reference(x, w_q, w_scale, bias.to(dtype)), backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
def test_edge_rows(backend):
    """Zero row -> bias exactly; NaN / +Inf / -Inf rows -> all-NaN; huge and tiny rows -> finite, as reference.

    Rows 7 and 8 have amax below 127 / FLT_MAX, where the reference's 127 / amax overflows to Inf
    (nonzero entries quantize to +-127, zeros to 0): every backend must reproduce that too.
    """
    w_q, w_scale, bias = make_layer(n=24, k=40)
    x = make_x((9, 40))
    x[7] *= 1e-38
    x[8, ::3] = 0.0
    x[8] *= 1e-41
    x[1] = 0.0
    x[2, 5] = float("nan")
    x[3, 0] = float("inf")
    x[4, 39] = float("-inf")
    x[5] *= 1e30
    x[6] *= 1e-30
    y = dispatch.w8a8_linear(x, w_q, w_scale, bias, backend=backend)
    assert torch.equal(y[1], bias), "an all-zero row must give exactly the bias"
    assert torch.isnan(y[2:5]).all(), "rows holding NaN/Inf must be NaN in every column"
    assert torch.isfinite(y[[0, 5, 6, 7, 8]]).all()
    assert_matches_reference(y, w8a8_linear_reference(x, w_q, w_scale, bias), backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
def test_prescale_and_no_bias(backend):
    w_q, w_scale, _ = make_layer(n=33, k=50, with_bias=False)
    prescale = torch.rand(50, generator=torch.Generator().manual_seed(3)) + 0.5
    x = make_x((4, 50), torch.bfloat16)
    y = dispatch.w8a8_linear(x, w_q, w_scale, None, act_prescale=prescale, backend=backend)
    assert_matches_reference(y, w8a8_linear_reference(x, w_q, w_scale, None, prescale), backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS, indirect=True)
def test_non_contiguous_input(backend):
    w_q, w_scale, bias = make_layer(n=16, k=32)
    x = make_x((32, 6)).t()  # [6, 32] with stride (1, 6)
    assert not x.is_contiguous()
    y = dispatch.w8a8_linear(x, w_q, w_scale, bias, backend=backend)
    assert_matches_reference(y, w8a8_linear_reference(x, w_q, w_scale, bias), backend)


def test_w8a8_is_close_to_float_linear():
    """Sanity of the scheme itself: W8A8 output vs the fp32 linear has SQNR well above 30 dB."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 256, generator=g)
    x = torch.randn(8, 256, generator=g)
    w_q, w_scale = quantize_weight_per_channel(w)
    y = dispatch.w8a8_linear(x, w_q, w_scale, backend="torch")
    ref = x @ w.t()
    sqnr_db = 10 * math.log10(ref.pow(2).sum() / (y - ref).pow(2).sum())
    assert sqnr_db > 30, f"SQNR {sqnr_db:.1f} dB"


@pytest.mark.parametrize("m", [1, 3, 16])
def test_torch_backend_exact_accumulators_and_layouts(m):
    """torch._int_mm gives the reference's int32 accumulators in both weight layouts (M=1 and M>1 paths)."""
    from quasar_hf.ops.cpu import int8_matmul_torch, prepare_cpu_weight, quantize_per_token_fast

    w_q, _, _ = make_layer(n=45, k=77)
    x = make_x((m, 77))
    x[0] = 0.0
    a_q, a_scale = quantize_per_token(x)
    fast_q, fast_scale = quantize_per_token_fast(x)
    assert torch.equal(fast_q, a_q) and torch.equal(fast_scale, a_scale)
    expected = a_q.long() @ w_q.long().t()
    assert torch.equal(int8_matmul_torch(a_q, w_q).long(), expected)
    assert torch.equal(int8_matmul_torch(a_q, w_q, prepare_cpu_weight(w_q)).long(), expected)


def test_fast_quantizer_zeroes_non_finite_rows():
    from quasar_hf.ops.cpu import quantize_per_token_fast

    x = make_x((3, 20))
    x[0, 1] = float("nan")
    x[1, 2] = float("inf")
    q, scale = quantize_per_token_fast(x)
    ref_q, _ = quantize_per_token(x)
    assert torch.equal(q, ref_q) and not q[:2].any()
    assert not torch.isfinite(scale[:2]).any()


def test_bitsandbytes_error_is_explained():
    """bitsandbytes differs from the reference only by its half-to-even ties and fp32 epilogue order.

    Bound per element: a_scale[m] * w_scale[n] * sum_k |q_bnb - q_ref|[m, k] * |w_q[n, k]|
    (the int8 disagreements), plus 3e-5 of the pre-bias output for the epilogue (bitsandbytes'
    CPU dequant multiplies by 6.200124e-05 = 1/127**2 * (1 + 1.8e-5), in another order), plus
    1e-5 absolute for rounding the bias sum.
    """
    bnb_functional = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes is not installed")
    w_q, w_scale, bias = make_layer(n=40, k=96)
    x = make_x((6, 96))
    x[2] = 0.0
    x[2, :8] = torch.tensor([127.0, 0.5, -1.5, 2.5, -2.5, 10.5, -0.5, 3.0])  # amax 127: v = x, exact ties
    y = dispatch.w8a8_linear(x, w_q, w_scale, bias, backend="bitsandbytes")
    ref = w8a8_linear_reference(x, w_q, w_scale, bias)
    q_ref, a_scale = quantize_per_token(x)
    q_bnb, _, _ = bnb_functional.int8_vectorwise_quant(x.contiguous())
    q_diff = (q_bnb.long() - q_ref.long()).abs()
    assert q_diff.max() <= 1, "int8 values may differ by one step on ties, never more"
    assert q_diff[2].sum() >= 4, "the planted .5 ties must round differently (half-to-even vs half-up)"
    bound = a_scale * w_scale * (q_diff.double() @ w_q.abs().double().t()).float() + 3e-5 * (ref - bias).abs() + 1e-5
    assert ((y - ref).abs() <= bound).all()


@pytest.mark.parametrize("scale", [1e-38, 3e-37, 1e-41])
def test_fast_quantizer_matches_reference_on_tiny_rows(scale):
    """Rows whose amax makes 127 / amax overflow: same int8 values (+-127 and 0) as the reference."""
    from quasar_hf.ops.cpu import quantize_per_token_fast

    x = make_x((2, 30)) * scale
    x[1, ::2] = 0.0
    q, s = quantize_per_token_fast(x)
    ref_q, ref_s = quantize_per_token(x)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s)


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (5, 64, 48), (20, 64, 48), (3, 70, 48), (3, 64, 37)])
def test_cuda_int_mm_workarounds_are_exact(m, k, n):
    """The CUDA path's M-padding (M <= 16) and fp64 fallback (K or N not multiples of 8) keep exact
    accumulators; run here on CPU tensors, where torch._int_mm accepts the same padded shapes."""
    from quasar_hf.ops.cpu import _int_mm_cuda

    w_q, _, _ = make_layer(n=n, k=k)
    a_q, _ = quantize_per_token(make_x((m, k)))
    acc = _int_mm_cuda(a_q, w_q)
    assert acc.dtype == torch.int32 and acc.shape == (m, n)
    assert torch.equal(acc.long(), a_q.long() @ w_q.long().t())
