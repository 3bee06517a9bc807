"""The kernels as PyTorch operators: schema and fake implementations (opcheck), the same bits as
the eager calls, the packed layout passed in as tensors, and a tiny W8A8 model traced by
torch.compile into one graph without breaks."""

from __future__ import annotations

import pytest
import torch

from quasar_hf.nn import W8A8Linear
from quasar_hf.ops import attention_cpu, dispatch
from quasar_hf.ops.reference import quantize_weight_per_channel, w8a8_linear_reference
from quasar_hf.ops.rowstable_attention import use_rowstable_attention
from tests.helpers.tiny_models import recording_aot_eager, tiny_model

CPU_BACKENDS = [b for b in ("reference", "torch", "cpu_fused") if b in dispatch.available_backends("cpu")]


def _layer(n=24, k=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(n, k, generator=g))
    return w_q, w_scale, torch.randn(n, generator=g), torch.rand(k, generator=g) + 0.5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_w8a8_op_passes_opcheck_and_matches_eager(backend):
    w_q, w_scale, bias, prescale = _layer()
    x = torch.randn(2, 3, 40).bfloat16()
    prepared = dispatch.prepare_w8a8(w_q, w_scale, bias, prescale, backend)
    args = (x, w_q, w_scale, bias, prescale, list(prepared.packed_tensors), prepared.backend)
    torch.library.opcheck(torch.ops.quasar.w8a8_linear.default, args, test_utils=("test_schema", "test_faketensor"))
    out = torch.ops.quasar.w8a8_linear(*args)
    assert out.shape == (2, 3, 24) and out.dtype == torch.bfloat16
    assert torch.equal(out, w8a8_linear_reference(x, w_q, w_scale, bias, prescale))


def test_w8a8_op_fake_gives_shape_and_the_eager_errors():
    w_q, w_scale, bias, _ = _layer()
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(5, 40))
        fake = torch.ops.quasar.w8a8_linear(x, mode.from_tensor(w_q), mode.from_tensor(w_scale), None, None, [], "reference")
        assert fake.shape == (5, 24)
        with pytest.raises(ValueError, match="in_features"):
            torch.ops.quasar.w8a8_linear(
                mode.from_tensor(torch.randn(5, 41)),
                mode.from_tensor(w_q),
                mode.from_tensor(w_scale),
                None,
                None,
                [],
                "reference",
            )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_w8a8_op_uses_the_packed_tensors_it_is_given(backend):
    """The op holds no cache: with the prepared layout it runs it, without one it packs per call."""
    w_q, w_scale, bias, _ = _layer()
    x = torch.randn(4, 40)
    prepared = dispatch.prepare_w8a8(w_q, w_scale, bias, None, backend)
    packed = list(prepared.packed_tensors)
    expected = w8a8_linear_reference(x, w_q, w_scale, bias)
    assert torch.equal(torch.ops.quasar.w8a8_linear(x, w_q, w_scale, bias, None, packed, prepared.backend), expected)
    assert torch.equal(torch.ops.quasar.w8a8_linear(x, w_q, w_scale, bias, None, [], prepared.backend), expected)
    if packed:  # what the op runs is the layout it was handed (an edit needs a new prepare_w8a8)
        w_q.neg_()
        stale = torch.ops.quasar.w8a8_linear(x, w_q, w_scale, bias, None, packed, prepared.backend)
        assert torch.equal(stale, expected)


@pytest.mark.kernels("attention")
def test_attention_op_passes_opcheck_and_matches_eager():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    visible = torch.rand(2, 3, 9, generator=g) > 0.3
    args = (q, k, v, visible, 0.3)
    torch.library.opcheck(torch.ops.quasar.rowstable_attention.default, args, test_utils=("test_schema", "test_faketensor"))
    assert torch._C._dispatch_has_kernel_for_dispatch_key("quasar::rowstable_attention", "CPU")  # C++ serves it


def _tiny_w8a8(dtype=torch.bfloat16):
    model = tiny_model("llama", dtype=dtype)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and name != "lm_head":
                setattr(module, name, W8A8Linear.from_linear(child))
    use_rowstable_attention(model)
    return model


def test_tiny_w8a8_model_traces_into_one_graph_with_the_quasar_ops():
    """fullgraph=True: the W8A8 linears and the row-stable attention trace as ops (no graph
    break); aot_eager runs the traced graph with eager kernels, so the bits are eager's."""
    model = _tiny_w8a8()
    ids = torch.randint(0, 96, (1, 12))
    seen = []
    backend = recording_aot_eager(seen)

    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model.forward, fullgraph=True, backend=backend)(input_ids=ids).logits
    assert sum("quasar.w8a8_linear" in t for t in seen) == 2 * 7
    if attention_cpu.is_available():
        assert sum("quasar.rowstable_attention" in t for t in seen) == 2
    assert torch.equal(compiled, eager)


def test_module_and_op_built_under_inference_mode_run():
    """Inference tensors keep no version counter: nothing here needs one."""
    w_q, w_scale, bias, _ = _layer()
    with torch.inference_mode():
        module = W8A8Linear.from_weight(torch.randn(24, 40), torch.randn(24))
        x = torch.randn(3, 40)
        y = module(x)
        w_q, w_scale, bias = w_q.clone(), w_scale.clone(), bias.clone()
        out = torch.ops.quasar.w8a8_linear(x, w_q, w_scale, bias, None, [], dispatch.resolve_backend("auto", "cpu"))
    assert torch.equal(y, w8a8_linear_reference(x, module.weight, module.weight_scale, module.bias))
    assert torch.equal(out, w8a8_linear_reference(x, w_q, w_scale, bias))
