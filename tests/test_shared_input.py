"""Sibling W8A8 linears (q/k/v, gate/up) quantize their shared input once: same bits as alone."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401  (registers quant_method "quasar")
from quasar_hf import QuasarConfig, W8A8Linear
from quasar_hf.nn.norm_fold import unfold_norm
from quasar_hf.nn.shared_input import MAX_UNCLAIMED, share_input, unshare_input
from quasar_hf.ops import cpu_fused
from quasar_hf.ops.multi import bind_w8a8_siblings
from quasar_hf.ops.reference import quantize_weight_per_channel, w8a8_linear_reference
from tests.tiny_models import assert_quasar_greedy_equals_plain, save_tiny

SHARED_BACKENDS = ["reference", "torch"] + (["cpu_fused"] if cpu_fused.is_available() else [])
FAST = dict(num_calibration_samples=4, calibration_seq_len=64)


def siblings(backend, prescale=True, sizes=(48, 20, 20), k=40, seed=0):
    """Linears reading one input: ragged output sizes, a bias on some, one shared act_prescale."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.rand(k, generator=g) + 0.5 if prescale else None
    modules = []
    for i, n in enumerate(sizes):
        linear = torch.nn.Linear(k, n, bias=i > 0)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=g))
        modules.append(W8A8Linear.from_linear(linear, act_prescale=shared, backend=backend))
    return modules


def alone(modules, x):
    """Each module's output computed by itself (its own bound kernel, no sharing)."""
    return [m.kernel()(x) for m in modules]


def inputs(k=40):
    g = torch.Generator().manual_seed(1)
    yield torch.randn(1, k, generator=g)
    yield torch.randn(2, 6, k, generator=g).bfloat16()
    yield torch.randn(3, k, generator=g).half()
    yield torch.randn(k, 5, generator=g).t()  # non-contiguous rows
    yield torch.zeros(2, k)  # all-zero rows: outputs are the bias
    yield torch.empty(0, 3, k)


@pytest.mark.parametrize("backend", SHARED_BACKENDS)
@pytest.mark.parametrize("prescale", [True, False])
def test_shared_outputs_are_bit_identical_to_each_linear_alone(backend, prescale):
    modules = siblings(backend, prescale)
    group = share_input(modules)
    for x in inputs():
        got = [m(x) for m in modules]
        assert group._linear is not None and group._pending is None, "one shared call, every output claimed"
        for y, expected in zip(got, alone(modules, x)):
            assert y.dtype == x.dtype and torch.equal(y, expected)
        v = modules[2]
        assert torch.equal(got[2], w8a8_linear_reference(x, v.weight, v.weight_scale, v.bias, v.act_prescale))


def test_one_shared_call_serves_every_member():
    modules = siblings("torch")
    group = share_input(modules)
    x = torch.randn(3, 40)
    modules[0](torch.randn(1, 40))  # binds the shared call
    calls = []
    real = group._linear
    group._linear = lambda t: calls.append(t) or real(t)
    for m in modules:
        m(x)
    assert len(calls) == 1
    assert torch.equal(modules[2](x), alone(modules, x)[2])  # claimed already: computed anew
    assert len(calls) == 2


def test_another_tensor_or_an_in_place_edit_is_never_served_a_stale_output():
    modules = siblings("torch")
    share_input(modules)
    x = torch.randn(4, 40)
    modules[0](x)
    other = x.clone()  # equal values, another tensor: computed for itself
    assert torch.equal(modules[1](other), alone(modules, other)[1])
    modules[0](x)
    x.mul_(2)  # edited in place after q_proj read it
    assert torch.equal(modules[1](x), alone(modules, x)[1])
    assert torch.equal(modules[2](x), alone(modules, x)[2])


def test_members_not_called_on_one_tensor_stop_sharing():
    modules = siblings("torch")
    group = share_input(modules)
    for _ in range(MAX_UNCLAIMED + 1):
        x = torch.randn(2, 40)
        for m in modules:
            y = m(x.clone())  # a fresh tensor per member, as a device-moving hook could give
            assert torch.equal(y, m.kernel()(x))
    assert group.stopped


def test_inference_tensors_and_different_prescales_run_alone():
    modules = siblings("torch")
    group = share_input(modules)
    with torch.inference_mode():
        x = torch.randn(2, 40)
        assert [torch.equal(a, b) for a, b in zip([m(x) for m in modules], alone(modules, x))] == [True] * 3
    assert group._linear is None  # never bound: inference tensors keep no version counter
    with torch.no_grad():
        modules[1].act_prescale.mul_(2)
    x = torch.randn(2, 40)
    assert all(torch.equal(a, b) for a, b in zip([m(x) for m in modules], alone(modules, x)))
    assert group._key is not None and group._linear is None


def test_a_changed_member_buffer_rebinds_the_shared_call():
    modules = siblings("torch")
    share_input(modules)
    x = torch.randn(2, 40)
    before = [m(x) for m in modules]
    with torch.no_grad():
        modules[2].weight_scale.mul_(3)
    after = [m(x) for m in modules]
    assert torch.equal(after[0], before[0]) and not torch.equal(after[2], before[2])
    assert torch.equal(after[2], alone(modules, x)[2])


@pytest.mark.parametrize("backend", SHARED_BACKENDS)
def test_grouped_modules_still_name_bad_input(backend):
    modules = siblings(backend)
    share_input(modules)
    with pytest.raises(ValueError, match="in_features"):
        modules[0](torch.randn(2, 41))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        modules[1](torch.ones(2, 40, dtype=torch.int32))


@pytest.mark.skipif(not cpu_fused.is_available(), reason="fused CPU kernel unavailable")
def test_cpu_fused_multi_call_threads_over_all_weights():
    """Weights big enough for several threads, split across weights: the same bits as one call each."""
    g = torch.Generator().manual_seed(2)
    weights = []
    for n in (256, 72, 72):
        w_q, w_scale = quantize_weight_per_channel(torch.randn(n, 300, generator=g))
        weights.append((w_q, w_scale, torch.randn(n, generator=g).bfloat16()))
    linear = bind_w8a8_siblings(weights, backend="cpu_fused")
    for m in (1, 6, 13):
        x = torch.randn(m, 300, generator=g).bfloat16()
        for y, (w_q, w_scale, bias) in zip(linear(x), weights):
            assert torch.equal(y, cpu_fused.w8a8_linear_cpu_fused(x, w_q, w_scale, bias))


def test_deepcopy_gives_the_copy_its_own_group():
    modules = torch.nn.ModuleList(siblings("torch"))
    share_input(list(modules))
    x = torch.randn(2, 40)
    modules[0](x)  # leaves two outputs pending in the original's group
    twin = copy.deepcopy(modules)
    assert twin[1].shared_input is not modules[1].shared_input
    assert twin[1].shared_input.members[1] is twin[1]
    assert all(torch.equal(a, b) for a, b in zip([m(x) for m in twin], alone(modules, x)))


@pytest.mark.parametrize("backend", SHARED_BACKENDS)
def test_quantized_model_shares_q_k_v_and_gate_up_with_the_same_logits(tmp_path, backend):
    path = save_tiny(tmp_path / "src", "qwen2", dtype=torch.bfloat16)  # q/k/v biases
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QuasarConfig(**FAST), dtype=torch.bfloat16)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.shared_input is layer.self_attn.v_proj.shared_input is not None
    assert layer.mlp.gate_proj.shared_input is layer.mlp.up_proj.shared_input is not None
    assert layer.mlp.down_proj.shared_input is None and layer.self_attn.o_proj.shared_input is None
    for m in model.modules():
        if isinstance(m, W8A8Linear):
            m.backend = backend
    for m in list(model.modules()):  # sharing alone here (the norm fold's bits: test_norm_fold.py)
        if "quasar_norm_fold" in m.__dict__:
            unfold_norm(m)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        shared = model(ids).logits
        groups = {m.shared_input for m in model.modules() if isinstance(m, W8A8Linear)} - {None}
        assert len(groups) == 4 and all(g._linear is not None for g in groups)
        for m in model.modules():
            if isinstance(m, W8A8Linear):
                unshare_input(m)
        assert torch.equal(model(ids).logits, shared)
    model.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.model.layers[1].mlp.up_proj.shared_input is not None


def test_greedy_quasar_equals_plain_greedy_with_shared_inputs(tmp_path):
    path = save_tiny(tmp_path / "src", "llama", dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QuasarConfig(**FAST), dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.k_proj.shared_input is not None
    assert_quasar_greedy_equals_plain(model, 30)
