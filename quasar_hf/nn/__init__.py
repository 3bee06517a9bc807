"""Quantized modules (plain and input-rotated), the folded RMSNorm that feeds them, the row-stable RMSNorm and float linear (the lm_head)."""

from quasar_hf.nn.folded_norm import FoldedRMSNorm, RMSNormOutput
from quasar_hf.nn.prepare import prepare_weights, set_backend
from quasar_hf.nn.rowstable_linear import RowStableLinear
from quasar_hf.nn.rowstable_norm import RowStableRMSNorm
from quasar_hf.nn.w8a8_linear import RotatedW8A8Linear, W8A8Linear, rotate_weight

__all__ = [
    "FoldedRMSNorm",
    "RMSNormOutput",
    "RotatedW8A8Linear",
    "RowStableLinear",
    "RowStableRMSNorm",
    "W8A8Linear",
    "rotate_weight",
    "prepare_weights",
    "set_backend",
]
