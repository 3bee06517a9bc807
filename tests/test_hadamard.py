"""Hadamard rotations: orthogonality of every construction, the fast transforms against the dense
oracle, the C kernel against the reference bit for bit, row-stability, and RotatedW8A8Linear."""

from __future__ import annotations

import pytest
import torch

from quasar_hf.nn import RotatedW8A8Linear, W8A8Linear, rotate_weight
from quasar_hf.ops import hadamard, hadamard_cpu
from quasar_hf.ops.hadamard import (
    HadamardRotation,
    paley_matrix,
    rotate_rows_float64,
    rotate_rows_reference,
    rotation_layout,
    sylvester_matrix,
)
from quasar_hf.ops.reference import w8a8_linear_reference
from quasar_hf.smoothquant.gptq import rotated_hessian

# Widths of the supported models' rotated inputs (576 SmolLM2 o_proj, 1536 its down_proj, 896/4864
# Qwen 0.5B, 640/2048 Gemma 270M, 8960 Qwen 1.5B), plus ragged ones: odd, 2 x odd, no Paley order.
WIDTHS = [1, 2, 3, 6, 12, 20, 24, 28, 96, 100, 576, 640, 896, 1536, 2048, 4864]


@pytest.mark.parametrize("order", [12, 20, 28, 36, 44, 76, 140, 148])
def test_paley_matrices_are_hadamard(order):
    h = paley_matrix(order)
    assert h is not None and set(h.unique().tolist()) == {-1, 1}
    assert torch.equal(h @ h.T, order * torch.eye(order, dtype=torch.int64))


def test_orders_without_a_paley_construction_are_refused():
    assert paley_matrix(92) is None  # 91 = 7 * 13 and 45 are not prime
    assert paley_matrix(10) is None  # not a multiple of 4
    with pytest.raises(ValueError, match="power-of-two"):
        sylvester_matrix(12)


@pytest.mark.parametrize("width", WIDTHS)
def test_rotation_is_orthonormal_and_covers_the_width(width):
    rotation = HadamardRotation.for_size(width)
    assert rotation.blocks * rotation.block == width
    q = rotation.matrix()
    assert torch.allclose(q @ q.T, torch.eye(width, dtype=torch.float64), atol=1e-12)


def test_supported_model_widths_get_one_full_block():
    for width in (576, 640, 896, 1536, 2048, 4864, 8960, 12288, 14336):
        assert HadamardRotation.for_size(width).blocks == 1, width
    assert rotation_layout(4864) == [1, 76, 64] and rotation_layout(1536) == [1, 12, 128]
    assert HadamardRotation.for_size(6).blocks == 3  # 2 x odd: blocks of H_2


@pytest.mark.parametrize("width", WIDTHS)
def test_fast_transforms_match_the_dense_oracle(width):
    rotation = HadamardRotation.for_size(width)
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(width), dtype=torch.float64)
    expected = x @ rotation.matrix()
    assert torch.allclose(rotate_rows_float64(x, rotation), expected, atol=1e-12, rtol=0)
    got = rotate_rows_reference(x.float(), rotation).double()
    assert got.dtype == torch.float64 and (got - expected).norm() / expected.norm() < 1e-6  # fp32 arithmetic


def test_rotate_rows_is_row_stable_and_takes_strided_rows():
    rotation = HadamardRotation.for_size(1536)
    x = torch.randn(6, 2 * 1536, generator=torch.Generator().manual_seed(2)).bfloat16()[:, ::2]  # inner stride 2
    many = hadamard_cpu.rotate_rows(x, rotation)
    for i in range(6):
        assert torch.equal(hadamard_cpu.rotate_rows(x[i : i + 1], rotation), many[i : i + 1])
    assert torch.equal(many, rotate_rows_reference(x, rotation))
    with pytest.raises(ValueError, match="rows of 1536"):
        rotate_rows_reference(torch.zeros(2, 100), rotation)


@pytest.mark.parametrize("k", [96, 1536, 2048])  # an odd order with H_n direct, then H_n split, with and without H_m
def test_rotated_hessian_is_q_transpose_h_q(k: int, monkeypatch):
    rotation = HadamardRotation.for_size(k)
    x = torch.randn(k + 50, k, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    h = x.T @ x
    q = rotation.matrix(torch.float64)
    expected = q.T @ h @ q
    rotated = rotated_hessian(h.float(), rotation)
    assert rotated.dtype == torch.float32
    assert float((rotated.double() - expected).norm() / expected.norm()) < 1e-6
    monkeypatch.setattr(hadamard, "GEMM_CHUNK_ELEMENTS", 7 * k)  # column chunks of 7, the last one ragged
    chunked = hadamard.rotate_columns_gemm(h.float(), rotation, torch.float32)
    left = q.T @ h
    assert float((chunked.double() - left).norm() / left.norm()) < 1e-6


def test_float64_rows_in_chunks_give_the_one_pass_result(monkeypatch):
    """Rows rotated a few at a time (a [K, K] Hessian at K = 8192 would otherwise hold several GB of
    temporaries) equal the one-pass rotation and the dense oracle, on a batch with leading dims."""
    from quasar_hf.ops import hadamard

    rotation = HadamardRotation.for_size(96)
    x = torch.randn(2, 7, 96, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    whole = rotate_rows_float64(x, rotation)
    monkeypatch.setattr(hadamard, "GEMM_CHUNK_ELEMENTS", 3 * 96)  # three rows per pass, a ragged last one
    chunked = rotate_rows_float64(x, rotation)
    assert chunked.shape == x.shape and torch.equal(chunked, whole)
    assert torch.allclose(chunked, x @ rotation.matrix(), atol=1e-12, rtol=0)


def _rotated_linear(k: int = 96, n: int = 40, dtype: torch.dtype = torch.float32, seed: int = 4):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen).to(dtype)
    rotation = HadamardRotation.for_size(k)
    return weight, bias, RotatedW8A8Linear.from_weight(rotate_weight(weight, rotation).float(), bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotated_linear_is_w8a8_of_the_rotated_input(dtype):
    weight, bias, module = _rotated_linear(dtype=dtype)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(5)).to(dtype)
    expected = w8a8_linear_reference(rotate_rows_reference(x, module.rotation), module.weight, module.weight_scale, bias)
    got = module(x)
    assert got.dtype == dtype and torch.equal(got, expected.to(dtype))
    exact = x.float() @ weight.T + bias.float()  # the float function the rotation must keep
    assert (got.float() - exact).norm() / exact.norm() < 0.03
    for i in range(5):  # a one-row (decode) call gives the same bits as the five-row (verify) call
        assert torch.equal(module(x[i : i + 1]), got[i : i + 1])


def test_rotation_spreads_an_outlier_channel():
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(64, 1536, generator=gen)
    x = torch.randn(8, 1536, generator=gen)
    x[:, 7] *= 300.0  # one channel 300x the others, as down_proj inputs have
    exact = x @ weight.T
    plain = W8A8Linear.from_weight(weight)(x)
    rotated = RotatedW8A8Linear.from_weight(rotate_weight(weight, HadamardRotation.for_size(1536)).float())(x)
    plain_err = (plain - exact).norm() / exact.norm()
    rotated_err = (rotated - exact).norm() / exact.norm()
    assert rotated_err < plain_err / 3, (float(plain_err), float(rotated_err))


def test_rotated_linear_refuses_a_prescale():
    with pytest.raises(ValueError, match="no act_prescale"):
        RotatedW8A8Linear(96, 8, has_act_prescale=True)


def test_rotated_linear_compiles_to_its_ops_with_the_eager_bits():
    from tests.helpers.tiny_models import recording_aot_eager

    _, _, module = _rotated_linear(dtype=torch.bfloat16)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(7)).bfloat16()
    seen: list[str] = []
    compiled = torch.compile(module, backend=recording_aot_eager(seen), fullgraph=True)
    assert torch.equal(compiled(x), module(x))
    assert any("hadamard_rows" in t for t in seen) and any("w8a8_linear" in t for t in seen), seen


def test_keep_float_measures_a_rotated_linear_as_rotated():
    from quasar_hf.smoothquant.linear_error import calibration_error

    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(32, 1536, generator=gen)
    samples = torch.randn(16, 1536, generator=gen)
    samples[:, 11] *= 300.0
    plain = calibration_error(samples, weight, weight)
    rotated = calibration_error(samples, weight, weight, rotation=HadamardRotation.for_size(1536))
    assert rotated["act_rel_mse"] < plain["act_rel_mse"] / 3


def test_rotations_and_the_kernel_are_built_on_the_cpu_inside_a_meta_device_context():
    """Checkpoints load under a meta-device context: a Paley order (Qwen's 4864 = H_76 x H_64) must still build."""
    with torch.device("meta"):
        rotation = HadamardRotation.for_size(4864)
        signs = rotation.odd_signs()
        assert rotation_layout(4864) == [1, 76, 64] and signs.device.type == "cpu"
        assert hadamard_cpu.unavailable_reason() is None or hadamard_cpu.missing_cpu_flags(("avx2",))
    x = torch.randn(2, 4864, generator=torch.Generator().manual_seed(9)).bfloat16()
    assert torch.equal(hadamard_cpu.bind_rotation(rotation)(x), rotate_rows_reference(x, rotation))
