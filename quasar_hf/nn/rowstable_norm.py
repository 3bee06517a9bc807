"""RowStableRMSNorm: a Transformers RMSNorm whose compiled form is one opaque op of ours.

Under `torch.compile` Inductor would generate its own reduction for a norm, and how it splits
and vectorizes that reduction may depend on the number of rows in the call; a verify step's row
could then differ from its decode step. Every RMSNorm of a Quasar model that is not folded into
its W8A8 consumers (the final norm, Qwen3 / Gemma 3 q/k norms, Gemma 3's feed-forward norms) is
replaced at load by this module, holding the same weight Parameter (state dicts are unchanged).
It computes the class's formula op for op in torch's eager kernels (`transformers_rms_norm_reference`,
tested against each class bit for bit), each row reduced alone: directly when eager, and as the
op `quasar::rms_norm` when compiled.
"""

from __future__ import annotations

import torch
from torch import nn

from quasar_hf.architectures import NORM_FORMULAS, norm_formula_for_class
from quasar_hf.ops.reference import transformers_rms_norm_reference

RMSNORM_FORMULAS = NORM_FORMULAS  # class name -> RMSNormFormula (quasar_hf/architectures.py)


def rms_norm_formula(norm: nn.Module) -> tuple[float, float, bool] | None:
    """(eps, offset, scale_in_float) of a known RMSNorm module (or a RowStableRMSNorm), else None."""
    if isinstance(norm, RowStableRMSNorm):
        return norm.formula
    known = norm_formula_for_class(type(norm).__name__)
    if known is None:
        return None
    eps, weight = getattr(norm, known.eps_attribute, None), getattr(norm, "weight", None)
    if not isinstance(eps, (int, float)) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    return float(eps), known.offset, known.scale_in_float


def compiled_rms_norm(x: torch.Tensor, weight: torch.Tensor, formula: tuple[float, float, bool]) -> torch.Tensor:
    """The norm as one opaque op (what a compiled step runs): [..., K] -> [..., K]."""
    import quasar_hf.ops.torch_ops  # noqa: F401  (registers torch.ops.quasar.*)

    eps, offset, scale_in_float = formula
    return torch.ops.quasar.rms_norm(x, weight, eps, offset, scale_in_float)


class RowStableRMSNorm(nn.Module):
    """A known RMSNorm's formula over its weight Parameter; `quasar::rms_norm` under torch.compile."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        formula = rms_norm_formula(norm)
        if formula is None:
            raise TypeError(f"{type(norm).__name__} is not an RMSNorm class quasar_hf knows: {sorted(RMSNORM_FORMULAS)}")
        self.weight = norm.weight
        self.formula = formula
        self.replaces = type(norm).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., K]
        if torch.compiler.is_compiling():
            return compiled_rms_norm(x, self.weight, self.formula)
        return transformers_rms_norm_reference(x, self.weight, *self.formula)

    def extra_repr(self) -> str:
        eps, offset, _ = self.formula
        return f"{tuple(self.weight.shape)}, eps={eps}, offset={offset}, replaces={self.replaces}"
