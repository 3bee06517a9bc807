"""RowStableRMSNorm and quasar::rms_norm: eager, the bits of each Transformers RMSNorm class; compiled,
the op's row-stable C kernel (its reference's bits, each row reduced alone, within one rounding of
the class); and every unfolded norm of a Quasar model replaced at load."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch._dynamo

from quasar_hf.nn import NormFoldedW8A8Linear, RowStableRMSNorm
from quasar_hf.nn.rowstable_norm import RMSNORM_FORMULAS, compiled_rms_norm
from quasar_hf.ops.reference import rowstable_rms_norm_reference
from tests.helpers.tiny_models import tiny_model

MODULES = {
    "LlamaRMSNorm": "llama",
    "MistralRMSNorm": "mistral",
    "Qwen2RMSNorm": "qwen2",
    "Qwen3RMSNorm": "qwen3",
    "Phi3RMSNorm": "phi3",
    "Gemma3RMSNorm": "gemma3",
}


def transformers_norm(name: str, dtype: torch.dtype, size: int = 64) -> torch.nn.Module:
    module = importlib.import_module(f"transformers.models.{MODULES[name]}.modeling_{MODULES[name]}")
    cls = getattr(module, name)
    norm = cls(size, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=torch.Generator().manual_seed(0)) * 0.5 + (0 if "Gemma" in name else 1))
    return norm.to(dtype)


def test_every_known_class_is_covered():
    assert set(MODULES) == set(RMSNORM_FORMULAS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_the_module_and_the_op_give_the_class_bits(name, dtype):
    norm = transformers_norm(name, dtype)
    ours = RowStableRMSNorm(norm)
    assert ours.weight is norm.weight
    x = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    with torch.no_grad():
        expected = norm(x)
        assert torch.equal(ours(x), expected)
        assert expected.dtype == ours(x).dtype
        # Compiled steps run the op: the row-stable kernel's own bits, within a rounding of the class's
        op = compiled_rms_norm(x, norm.weight, ours.formula)
        assert torch.equal(op, rowstable_rms_norm_reference(x, norm.weight, *ours.formula)) and op.dtype == expected.dtype
        step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20  # one rounding of the output, relative
        assert bool(((op.float() - expected.float()).abs() <= step * expected.float().abs() + 1e-30).all())


@pytest.mark.kernels("rms_norm")
@pytest.mark.parametrize("width", [1, 7, 8, 9, 64, 576, 1001, 1027])  # 1001, 1027: past one 512-wide chunk, ragged tails
@pytest.mark.parametrize("formula", [(1e-6, 0.0, False), (1e-6, 1.0, True)])
def test_the_kernel_equals_its_reference_and_a_row_alone(width, formula):
    generator = torch.Generator().manual_seed(width)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(6, width, generator=generator) * 5).to(dtype)
        w = torch.randn(width, generator=generator).to(dtype)
        out = torch.ops.quasar.rms_norm(x, w, *formula)  # the C++ implementation (checked above)
        assert torch.equal(out, rowstable_rms_norm_reference(x, w, *formula)), (dtype, width)
        assert torch.equal(torch.cat([torch.ops.quasar.rms_norm(x[i : i + 1], w, *formula) for i in range(6)]), out)


def test_the_op_takes_transposed_views_and_matches_its_fake():
    """Gemma's q/k norms read [B, H, T, D] views of [B, T, H, D]: the output is contiguous, as the fake says."""
    x = torch.randn(1, 6, 4, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).transpose(1, 2)
    w = torch.randn(32).to(torch.bfloat16)
    out = torch.ops.quasar.rms_norm(x, w, 1e-6, 1.0, True)
    assert out.is_contiguous() and torch.equal(out, torch.ops.quasar.rms_norm(x.contiguous(), w, 1e-6, 1.0, True))
    torch.library.opcheck(
        torch.ops.quasar.rms_norm.default, (x, w, 1e-6, 1.0, True), test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize("name", ["LlamaRMSNorm", "Gemma3RMSNorm"])
def test_compiled_rows_equal_one_row_calls(name):
    """Under Inductor the norm is one opaque op: each row of a 6-row call equals that row alone."""
    ours = RowStableRMSNorm(transformers_norm(name, torch.bfloat16, size=576))
    x = (torch.randn(6, 576, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: ours(t) * 2.0, fullgraph=True, dynamic=False)
    with torch.no_grad():
        rows = compiled(x)
        alone = torch.cat([compiled(x[i : i + 1]) for i in range(6)])
    torch._dynamo.reset()
    assert torch.equal(rows, alone)


def test_a_quasar_model_has_no_torch_rmsnorm_left(tmp_path):
    from transformers import AutoModelForCausalLM

    from quasar_hf import QuasarConfig
    from tests.helpers.tiny_archs import save_tiny_arch

    src = save_tiny_arch(tmp_path / "gemma3", "gemma3")
    config = QuasarConfig(num_calibration_samples=2, calibration_seq_len=32, weight_rounding="nearest", alpha=0.5)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Gemma3RMSNorm" not in kinds and {"RowStableRMSNorm", "NormFoldedW8A8Linear"} <= kinds
    source_keys = set(AutoModelForCausalLM.from_pretrained(src).state_dict())
    assert {k for k in model.state_dict() if k.endswith("norm.weight")} == {k for k in source_keys if k.endswith("norm.weight")}


def test_unknown_modules_are_refused():
    with pytest.raises(TypeError, match="not an RMSNorm class"):
        RowStableRMSNorm(tiny_model().model.embed_tokens)
    assert not isinstance(tiny_model().model.norm, (RowStableRMSNorm, NormFoldedW8A8Linear))  # only Quasar models change
