"""RMSNorm folded into the W8A8 activation quantization (nn/norm_fold.py, the fused CPU kernel).

Oracle: reference.w8a8_linear_rmsnorm_reference, bit for bit. The fold is a different rounding of
the same function as norm-then-quantize (no bf16 rounding of the normalized row), so model-level
tests check closeness to the unfolded model with a meaningful bound, bit-exact layer outputs
against the oracle, and that nothing unmarked or unfoldable is ever normalized twice or not at all.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401  (registers quant_method "quasar")
from quasar_hf import QuasarConfig
from quasar_hf.nn.norm_fold import NormFold, unfold_norm
from quasar_hf.ops import cpu_fused
from quasar_hf.ops.reference import (
    quantize_weight_per_channel,
    rms_factor_reference,
    w8a8_linear_rmsnorm_reference,
)
from tests.test_arch_gemma_phi import save_tiny_arch
from tests.tiny_models import assert_quasar_greedy_equals_plain, save_tiny

needs_kernel = pytest.mark.skipif(not cpu_fused.is_available(), reason=f"fused CPU kernel: {cpu_fused.unavailable_reason()}")
FAST = dict(num_calibration_samples=4, calibration_seq_len=64, weight_rounding="nearest")
IDS = torch.tensor([[5, 17, 33, 2, 64, 90, 11, 7, 48, 21, 3, 77, 40, 8, 19, 60]])


def test_rms_factor_reference_is_rmsnorm_to_float_precision():
    x = torch.randn(5, 100, dtype=torch.float64) * 3
    exact = 1.0 / torch.sqrt(x.pow(2).mean(-1) + 1e-6)
    got = rms_factor_reference(x.float(), 1e-6).double()
    assert torch.allclose(got, exact, rtol=1e-6, atol=0)


@needs_kernel
@pytest.mark.parametrize(
    ("k", "sizes", "m", "dtype"),
    [
        (64, (64, 32, 32), 1, torch.bfloat16),
        (100, (37, 5), 6, torch.float32),
        (33, (16,), 3, torch.float16),
        (576, (96, 48), 7, torch.bfloat16),
    ],
)
def test_kernel_with_norm_equals_the_oracle_bit_for_bit(k, sizes, m, dtype):
    from quasar_hf.ops.cpu_fused_multi import bind_linear_multi

    g = torch.Generator().manual_seed(k)
    weights = []
    for i, n in enumerate(sizes):
        q, s = quantize_weight_per_channel(torch.randn(n, k, generator=g))
        weights.append((q, s, torch.randn(n, generator=g).to(dtype) if i == 0 else None))
    scale = torch.rand(k, generator=g) + 0.5
    x = (torch.randn(m, k, generator=g) * 4).to(dtype)
    if m > 2:
        x[1] = 0  # a zero row: scale 0, outputs are the bias
        x[2, 0] = float("nan")  # a NaN row: NaN outputs
    outs = bind_linear_multi(weights, scale, norm_eps=1e-5)(x)
    for out, (q, s, b) in zip(outs, weights):
        expected = w8a8_linear_rmsnorm_reference(x, scale, 1e-5, q, s, b)
        assert out.dtype == dtype and torch.equal(out.nan_to_num(7.0), expected.nan_to_num(7.0))
    if m > 2:
        assert torch.isnan(outs[0][2]).all() and not torch.isnan(outs[0][[0, 1]]).any()


@needs_kernel
def test_bad_norm_eps_is_refused():
    from quasar_hf.ops.cpu_fused_multi import bind_linear_multi

    q, s = quantize_weight_per_channel(torch.randn(16, 32))
    for eps in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="norm_eps"):
            bind_linear_multi([(q, s, None)], torch.ones(32), norm_eps=eps)


def _quantized(tmp_path, arch: str, dtype=torch.bfloat16):
    if arch == "gemma3":
        src = save_tiny_arch(tmp_path / "src", "gemma3")
    else:
        src = save_tiny(tmp_path / "src", arch)
    return AutoModelForCausalLM.from_pretrained(src, quantization_config=QuasarConfig(**FAST), dtype=dtype).eval()


def _folds(model) -> list[NormFold]:
    return [m.__dict__["quasar_norm_fold"] for m in model.modules() if "quasar_norm_fold" in m.__dict__]


@contextlib.contextmanager
def armed(fold: NormFold):
    """As inside the fold's decoder layer forward (the only place its norm passes inputs through)."""
    fold.arming.depth += 1
    try:
        yield
    finally:
        fold.arming.depth -= 1


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_folded_layer_outputs_equal_the_oracle(tmp_path, arch):
    model = _quantized(tmp_path, arch)
    folds = _folds(model)
    assert len(folds) == 2 * model.config.num_hidden_layers  # attention input and MLP input norms
    x = (torch.randn(1, 5, model.config.hidden_size) * 2).to(torch.bfloat16)
    offset = 1.0 if arch == "gemma3" else 0.0
    with torch.no_grad():
        for fold in folds:
            assert torch.equal(fold.norm(x), fold.normalize(x))  # called outside its layer: computed
            with armed(fold):
                passed = fold.norm(x)
            assert fold.owns(passed) and torch.equal(passed, x)  # a marked view, not normalized yet
            scale = offset + fold.norm.weight.float()
            for member in fold.group.members:
                expected = w8a8_linear_rmsnorm_reference(x, scale, fold.eps, member.weight, member.weight_scale, member.bias)
                assert torch.equal(member(passed), expected)


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_folded_model_is_close_to_the_unfolded_one(tmp_path, arch):
    """Same function, one rounding fewer: logits differ by a fraction of the W8A8 error itself.
    Also the guard against an architecture whose forward puts an op between the norm and its
    linears (the linears would then read the raw input: logits far off)."""
    model = _quantized(tmp_path, arch, dtype=torch.float32)
    with torch.no_grad():
        folded = model(IDS).logits
        for fold in _folds(model):
            unfold_norm(fold.norm)
        assert not _folds(model)
        unfolded = model(IDS).logits
    rel = ((folded - unfolded).norm() / unfolded.norm()).item()
    assert 0 < rel < 1e-2, f"fold moved the logits by {rel:.2e} (relative)"


@needs_kernel
def test_unmarked_inputs_and_unfoldable_calls_are_never_misread(tmp_path):
    model = _quantized(tmp_path, "llama")
    fold = _folds(model)[0]
    norm, q_proj = fold.norm, fold.group.members[0]
    x = (torch.randn(1, 4, model.config.hidden_size) * 2).to(torch.bfloat16)
    with torch.no_grad(), armed(fold):
        normalized = fold.normalize(x)
        plain = q_proj.kernel()(normalized)
        assert torch.equal(q_proj(normalized.clone()), plain)  # unmarked: taken as it is
        marked = norm(x)
        marked.mul_(1.0)  # an in-place edit voids the mark: the tensor is no longer the norm's input
        assert not fold.owns(marked)
        fold.group.stopped = True  # sharing off: a member alone normalizes the marked input first
        assert torch.equal(q_proj(norm(x)), plain)
        fold.group.stopped = False
    with torch.inference_mode(), armed(fold):
        x_inference = x.clone()  # keeps no version counter: never marked, normalized on the spot
        assert not fold.owns(norm(x_inference)) and torch.equal(norm(x_inference), fold.normalize(x_inference))
    attention = model.model.layers[0].self_attn
    for watched in (norm, attention, q_proj):  # whatever a hook there sees is the real norm output
        handle = watched.register_forward_pre_hook(lambda module, args: None)
        with torch.no_grad(), armed(fold):
            assert torch.equal(norm(x), fold.normalize(x))
        handle.remove()
    with armed(fold):
        assert torch.equal(norm(x.double()), fold.normalize(x.double()))  # no fused float64 form
        assert torch.equal(norm(x.requires_grad_()), fold.normalize(x))  # autograd on: computed


@needs_kernel
def test_fold_keeps_checkpoints_and_copies(tmp_path):
    model = _quantized(tmp_path, "llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        logits = model(IDS).logits
    clone = copy.deepcopy(model)
    assert len(_folds(clone)) == len(_folds(model))
    assert all(f.norm.__dict__["quasar_norm_fold"] is f and f.group.norm is f for f in _folds(clone))
    model.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert state.keys() == reloaded.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in reloaded.state_dict().items())
    with torch.no_grad():
        assert torch.equal(clone(IDS).logits, logits)
        assert torch.equal(reloaded(IDS).logits, logits)


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_greedy_quasar_equals_plain_with_folded_norms(tmp_path, arch):
    model = _quantized(tmp_path, arch)
    assert _folds(model)
    assert_quasar_greedy_equals_plain(model, max_new_tokens=24)


@needs_kernel
def test_an_edited_norm_weight_is_folded_anew(tmp_path):
    model = _quantized(tmp_path, "llama")
    fold = _folds(model)[0]
    member = fold.group.members[0]
    x = (torch.randn(1, 3, model.config.hidden_size) * 2).to(torch.bfloat16)
    with torch.no_grad():
        with armed(fold):
            before = member(fold.norm(x))
        fold.norm.weight.mul_(2.0).add_(0.25)  # in place: same tensor, new version
        with armed(fold):
            after = member(fold.norm(x))
    scale = fold.norm.weight.float()
    assert not torch.equal(before, after)
    assert torch.equal(after, w8a8_linear_rmsnorm_reference(x, scale, fold.eps, member.weight, member.weight_scale, member.bias))
