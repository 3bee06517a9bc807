"""Row-stable float linear (the lm_head): the kernel equals its PyTorch oracle bit for bit, rows do
not depend on the row count or thread count, and a Quasar model's lm_head uses it with the same
Parameters (ties and checkpoints unchanged), so verify-step logits equal decode-step logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401  (registers quant_method "quasar")
from quasar_hf import QuasarConfig
from quasar_hf.nn import RowStableLinear
from quasar_hf.ops import rowstable_linear as kernel
from quasar_hf.ops.reference import rowstable_linear_reference
from quasar_hf.speculative.row_aligned_cache import RowAlignedCache
from tests.helpers.tiny_models import assert_quasar_greedy_equals_plain, save_tiny

needs_kernel = pytest.mark.kernels("rowstable_linear")
DTYPES = [torch.float32, torch.bfloat16]
# (M, K, N): decode, verification, row blocks of 6 plus a remainder, ragged K and a tail of N % 4
SHAPES = [(1, 64, 12), (6, 576, 9), (7, 17, 5), (13, 100, 31), (1, 1, 1), (2, 15, 4)]


def operands(m, k, n, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def test_reference_is_a_linear_within_fp32_rounding():
    x, w, b = operands(5, 300, 7, torch.float32)
    exact = (x.double() @ w.double().T + b.double()).float()
    got = rowstable_linear_reference(x, w, b)
    assert torch.allclose(got, exact, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_equals_reference_bit_for_bit(shape, dtype, bias):
    x, w, b = operands(*shape, dtype, bias=bias)
    assert torch.equal(kernel.rowstable_linear(x, w, b), rowstable_linear_reference(x, w, b))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_alone_in_a_batch_and_with_any_thread_count(dtype):
    x, w, b = operands(9, 200, 4099, dtype, seed=3)  # 4099 x 200: big enough to use two threads
    batched = kernel.rowstable_linear(x, w, b)
    for row in range(x.shape[0]):
        assert torch.equal(kernel.rowstable_linear(x[row : row + 1], w, b)[0], batched[row])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel.rowstable_linear(x, w, b), batched)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_layouts_leading_dims_and_special_values():
    x, w, b = operands(4, 40, 6, torch.bfloat16)
    strided = x.T.contiguous().T  # same values, rows not contiguous
    assert torch.equal(kernel.rowstable_linear(strided, w, b), rowstable_linear_reference(x, w, b))
    three_d = x.reshape(2, 2, 40)
    assert kernel.rowstable_linear(three_d, w, b).shape == (2, 2, 6)
    assert torch.equal(kernel.rowstable_linear(three_d, w, b).reshape(4, 6), rowstable_linear_reference(x, w, b))
    x[1, 3] = float("nan")
    out = kernel.rowstable_linear(x, w, b)
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()
    assert kernel.rowstable_linear(x[:0], w, b).shape == (0, 6)


@needs_kernel
def test_bad_inputs_are_refused_with_the_problem_named():
    x, w, b = operands(2, 8, 3, torch.float32)
    assert not kernel.supports(x.half(), w.half())  # float16: F.linear's job
    assert not kernel.supports(x, w.bfloat16())  # mixed dtypes
    with pytest.raises(ValueError, match="one dtype"):
        kernel.rowstable_linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="bias"):
        kernel.rowstable_linear(x, w, b[:2])


def test_module_shares_parameters_and_keeps_the_state_dict():
    linear = nn.Linear(16, 8, bias=True)
    module = RowStableLinear.from_linear(linear)
    assert module.weight is linear.weight and module.bias is linear.bias
    assert list(module.state_dict()) == list(linear.state_dict())
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = rowstable_linear_reference(x, linear.weight, linear.bias) if kernel.is_available() else linear(x)
        assert torch.equal(module(x), expected)
        half = RowStableLinear.from_linear(nn.Linear(16, 8).half())  # float16: plain F.linear
        assert torch.equal(half(x.half()), F.linear(x.half(), half.weight, half.bias))
    with pytest.raises(TypeError, match="nn.Linear"):
        RowStableLinear.from_linear(nn.Conv1d(2, 2, 1))


def test_module_output_bits_do_not_depend_on_grad_mode_and_gradients_are_a_linears():
    linear = nn.Linear(24, 10)
    module = RowStableLinear.from_linear(linear)
    x = torch.randn(4, 24, requires_grad=True)
    with torch.no_grad():
        no_grad_out = module(x)
    out = module(x)
    assert torch.equal(out.detach(), no_grad_out)
    out.square().sum().backward()
    grads = (x.grad.clone(), linear.weight.grad.clone(), linear.bias.grad.clone())
    x.grad = linear.weight.grad = linear.bias.grad = None
    F.linear(x, linear.weight, linear.bias).square().sum().backward()
    for got, expected in zip(grads, (x.grad, linear.weight.grad, linear.bias.grad)):
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def quantized_bf16(tmp_path_factory):
    folder = save_tiny(tmp_path_factory.mktemp("tiny_bf16"), "llama", dtype=torch.bfloat16)
    config = QuasarConfig(num_calibration_samples=2, calibration_seq_len=32, weight_rounding="nearest")
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.bfloat16).eval()


def test_quasar_model_lm_head_is_row_stable_and_still_tied(quantized_bf16, tmp_path):
    model = quantized_bf16
    assert isinstance(model.lm_head, RowStableLinear)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert isinstance(reloaded.lm_head, RowStableLinear)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)


@needs_kernel
def test_verify_step_logits_equal_decode_step_logits(quantized_bf16):
    """Six tokens in one forward give, row by row, the logits of six one-token forwards: bit for bit."""
    model, tokens = quantized_bf16, torch.randint(0, 96, (1, 26), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batched = RowAlignedCache(model, 1, torch.device("cpu"))
        batched.forward(tokens[:, :20])
        verify_logits = batched.forward(tokens[:, 20:])[0]  # [6, vocab]
        stepped = RowAlignedCache(model, 1, torch.device("cpu"))
        stepped.forward(tokens[:, :20])
        decode_logits = torch.cat([stepped.forward(tokens[:, i : i + 1])[0] for i in range(20, 26)])
    assert torch.equal(verify_logits, decode_logits)


def test_greedy_quasar_equals_plain_on_a_bf16_model(quantized_bf16):
    assert_quasar_greedy_equals_plain(quantized_bf16, max_new_tokens=24)
