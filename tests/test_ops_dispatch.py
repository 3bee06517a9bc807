"""The one dispatch point: backend resolution, availability errors, input validation, packing."""

from __future__ import annotations

import pytest
import torch

from quasar_hf.ops import backends, dispatch
from quasar_hf.ops.dispatch import available_backends, pack_weight_for, resolve_backend, w8a8_linear
from quasar_hf.ops.reference import quantize_weight_per_channel, w8a8_linear_reference


@pytest.fixture
def layer():
    g = torch.Generator().manual_seed(0)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(12, 20, generator=g))
    return w_q, w_scale, torch.randn(12, generator=g)


def test_available_backends_on_cpu():
    names = available_backends("cpu")
    assert names[:2] == ["reference", "torch"]
    assert set(names) <= set(dispatch.BACKENDS)


def test_auto_on_cpu_is_cpu_fused_when_available_else_torch():
    expected = "cpu_fused" if "cpu_fused" in available_backends("cpu") else "torch"
    assert resolve_backend("auto", "cpu") == expected


def test_auto_on_cpu_falls_back_to_torch_without_cpu_fused(monkeypatch):
    monkeypatch.setattr(backends, "cpu_fused_module", lambda: None)
    assert resolve_backend("auto", "cpu") == "torch"
    assert "cpu_fused" not in available_backends("cpu")


def test_unknown_backend_names_choices():
    with pytest.raises(ValueError, match="'fast'.*unknown backend.*Available here"):
        resolve_backend("fast", "cpu")


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch, layer):
    pytest.importorskip("triton", reason="triton is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    w_q, w_scale, bias = layer
    with pytest.raises(ValueError, match="'triton' is not available on 'cpu'.*CUDA.*TRITON_INTERPRET"):
        w8a8_linear(torch.randn(2, 20), w_q, w_scale, bias, backend="triton")


def test_missing_package_is_refused_with_install_hint(monkeypatch):
    real_find_spec = backends.importlib.util.find_spec
    monkeypatch.setattr(
        backends.importlib.util, "find_spec", lambda name: None if name == "bitsandbytes" else real_find_spec(name)
    )
    with pytest.raises(ValueError, match="bitsandbytes.*not installed.*pip install"):
        resolve_backend("bitsandbytes", "cpu")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "weight_q": a["weight_q"].float()}, "weight_q must be an int8"),
        (lambda a: {**a, "weight_q": a["weight_q"][0]}, "weight_q must be an int8"),
        (lambda a: {**a, "x": torch.randn(3, 21)}, "in_features .* = 20"),
        (lambda a: {**a, "x": torch.randn(3, 20, dtype=torch.float64)}, "x must be float32, bfloat16 or float16"),
        (lambda a: {**a, "weight_scale": a["weight_scale"].double()}, "weight_scale must be float32 of shape"),
        (lambda a: {**a, "weight_scale": a["weight_scale"][:5]}, r"weight_scale must be float32 of shape \(12,\)"),
        (lambda a: {**a, "bias": torch.randn(11)}, r"bias must be a float tensor of shape \(12,\)"),
        (lambda a: {**a, "act_prescale": torch.ones(19)}, r"act_prescale must be float32 of shape \(20,\)"),
        (lambda a: {**a, "x": torch.randn(3, 20, device="meta")}, "all tensors must be on one device"),
    ],
)
def test_bad_inputs_name_the_tensor(layer, change, message):
    w_q, w_scale, bias = layer
    args = {"x": torch.randn(3, 20), "weight_q": w_q, "weight_scale": w_scale, "bias": bias, "act_prescale": None}
    with pytest.raises((ValueError, TypeError), match=message):
        w8a8_linear(**change(args), backend="reference")


def test_non_tensor_input_is_a_type_error(layer):
    w_q, w_scale, _ = layer
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        w8a8_linear([[1.0] * 20], w_q, w_scale)


def test_empty_batch_returns_empty_output(layer):
    w_q, w_scale, bias = layer
    y = w8a8_linear(torch.randn(0, 5, 20, dtype=torch.bfloat16), w_q, w_scale, bias, backend="torch")
    assert y.shape == (0, 5, 12) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_packed_weight_is_used_and_foreign_packs_are_ignored(layer, backend):
    w_q, w_scale, bias = layer
    x = torch.randn(4, 20)
    ref = w8a8_linear_reference(x, w_q, w_scale, bias)
    packed = pack_weight_for(w_q, backend)
    assert torch.equal(w8a8_linear(x, w_q, w_scale, bias, backend=backend, packed=packed), ref)
    # a pack made for another backend is ignored, never misread
    assert torch.equal(w8a8_linear(x, w_q, w_scale, bias, backend="torch", packed=object()), ref)


def test_pack_for_torch_holds_the_transposed_weight(layer):
    w_q, _, _ = layer
    packed = pack_weight_for(w_q, "torch")
    assert packed.weight_kn.is_contiguous() and torch.equal(packed.weight_kn, w_q.t())
    assert pack_weight_for(w_q, "reference") is None


@pytest.mark.parametrize("backend", available_backends("cpu"))
def test_bound_linear_computes_the_same_bits_and_checks_x(layer, backend):
    w_q, w_scale, bias = layer
    prescale = torch.rand(20) + 0.5
    linear = dispatch.bind_w8a8_linear(w_q, w_scale, bias, prescale, backend=backend)
    for x in (torch.randn(1, 20), torch.randn(2, 3, 20).bfloat16(), torch.randn(0, 20)):
        expected = w8a8_linear(x, w_q, w_scale, bias, prescale, backend=backend)
        assert torch.equal(linear(x), expected)
    with pytest.raises(ValueError, match="in_features"):
        linear(torch.randn(4, 21))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        linear(torch.ones(4, 20, dtype=torch.int32))


def test_w8a8_linear_module_uses_what_prepare_bound_until_prepared_again():
    """The forward checks nothing: after any edit of a buffer, prepare() is what makes it count."""
    from quasar_hf.nn import W8A8Linear

    module = W8A8Linear.from_linear(torch.nn.Linear(20, 12), act_prescale=torch.rand(20) + 0.5, backend="torch")
    x = torch.randn(3, 20)
    before = module(x)
    module.weight.mul_(-1)  # in place: the packed [K, N] copy still holds the old weight
    assert torch.equal(module(x), before)
    for edit in (
        lambda: module.weight_scale.mul_(2),
        lambda: module.act_prescale.mul_(2),
        lambda: module.bias.mul_(2),
        lambda: setattr(module, "weight_scale", module.weight_scale.clone() * 0),  # a replaced buffer
        lambda: setattr(module.weight_scale, "data", torch.ones(12)),  # new storage, same tensor object
    ):
        edit()
        module.prepare()
        assert torch.equal(module(x), w8a8_linear(x, module.weight, module.weight_scale, module.bias, module.act_prescale))
    assert not torch.equal(module(x), before)
