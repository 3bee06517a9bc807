"""A dtype change of a Quasar model is all or nothing (hf/binding.py, nn/prepared_module.py).

`.to(torch.float16)`, `.half()`, `.float()` and back convert every float tensor except the fp32
quantization scales (kept bit for bit) and leave the int8 weights alone, and greedy `quasar=True`
still equals plain greedy decoding; a dtype the kernels do not take is refused before any tensor changes.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig
from quasar_hf.hf.fusion import checkpoint_linears
from tests.helpers.tiny_models import assert_quasar_greedy_equals_plain, save_tiny


@pytest.fixture
def model(tmp_path):
    source = save_tiny(tmp_path / "src", "llama", dtype=torch.bfloat16)
    config = QuasarConfig(num_calibration_samples=4, calibration_seq_len=32)
    return AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in model.state_dict().items()}


def _quantized_tensors(model) -> dict[str, torch.Tensor]:
    """Every W8A8 linear's int8 weight and fp32 scales, under their checkpoint names (fused groups split)."""
    state = model.state_dict()
    keys = (f"{name}.{attr}" for name in checkpoint_linears(model) for attr in ("weight", "weight_scale", "act_prescale"))
    return {key: state[key] for key in keys if key in state}


@pytest.mark.parametrize(
    "convert, dtype",
    [
        (lambda m: m.to(torch.float16), torch.float16),
        (lambda m: m.to(dtype=torch.float32), torch.float32),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.float(), torch.float32),
    ],
    ids=["to-float16", "to-dtype-float32", "half", "float"],
)
def test_a_dtype_change_converts_the_whole_model_and_keeps_quantization_exact(model, convert, dtype):
    before = {name: t.clone() for name, t in _quantized_tensors(model).items()}
    assert convert(model) is model
    after = _quantized_tensors(model)
    assert after.keys() == before.keys()
    for name, tensor in after.items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name
    floats = {n: t.dtype for n, t in model.state_dict().items() if t.is_floating_point() and n not in after}
    assert set(floats.values()) == {dtype}, floats
    assert model.dtype == dtype
    assert_quasar_greedy_equals_plain(model, max_new_tokens=12)
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert_quasar_greedy_equals_plain(model, max_new_tokens=12)


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.float64), lambda m: m.double(), lambda m: m.to(torch.complex64)])
def test_a_dtype_the_kernels_do_not_take_is_refused_before_anything_changes(model, convert):
    before = _snapshot(model)
    with pytest.raises(
        ValueError, match=r"computes in float32, bfloat16 or float16.*nothing was converted.*model\.to\(torch\.bfloat16\)"
    ):
        convert(model)
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in after.items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), name
    assert_quasar_greedy_equals_plain(model, max_new_tokens=8)


def test_a_device_move_keeps_the_model_whole(model):
    before = _snapshot(model)
    model.to("cpu")
    model.cpu()
    assert all(torch.equal(t, before[n]) and t.dtype == before[n].dtype for n, t in model.state_dict().items())
    assert_quasar_greedy_equals_plain(model, max_new_tokens=8)
