"""RowStableRMSNorm and quasar::rms_norm: the bits of each Transformers RMSNorm class, rows reduced
alone (eager and compiled), and every unfolded norm of a Quasar model replaced at load."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch._dynamo

from quasar_hf.nn import FoldedRMSNorm, RowStableRMSNorm
from quasar_hf.nn.rowstable_norm import RMSNORM_FORMULAS, compiled_rms_norm
from tests.tiny_models import tiny_model

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
        assert torch.equal(compiled_rms_norm(x, norm.weight, ours.formula), expected)
        assert expected.dtype == ours(x).dtype


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
    from tests.test_arch_gemma_phi import save_tiny_arch

    src = save_tiny_arch(tmp_path / "gemma3", "gemma3")
    config = QuasarConfig(num_calibration_samples=2, calibration_seq_len=32, weight_rounding="nearest", alpha=0.5)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Gemma3RMSNorm" not in kinds and {"RowStableRMSNorm", "FoldedRMSNorm"} <= kinds
    source_keys = set(AutoModelForCausalLM.from_pretrained(src).state_dict())
    assert {k for k in model.state_dict() if k.endswith("norm.weight")} == {k for k in source_keys if k.endswith("norm.weight")}


def test_unknown_modules_are_refused():
    with pytest.raises(TypeError, match="not an RMSNorm class"):
        RowStableRMSNorm(tiny_model().model.embed_tokens)
    assert not isinstance(tiny_model().model.norm, (RowStableRMSNorm, FoldedRMSNorm))  # only Quasar models change
