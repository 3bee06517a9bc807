"""Quantized modules (plain and input-rotated), an RMSNorm folded into the projections it feeds, the row-stable RMSNorm and float linear (the lm_head)."""

from quasar_hf.nn.norm_folded_linear import FusedProjectionSlice, NormFoldedW8A8Linear
from quasar_hf.nn.prepare import prepare_weights, set_backend
from quasar_hf.nn.rowstable_linear import RowStableLinear
from quasar_hf.nn.rowstable_norm import RowStableRMSNorm
from quasar_hf.nn.w8a8_linear import RotatedW8A8Linear, W8A8Linear, rotate_weight

__all__ = [
    "FusedProjectionSlice",
    "NormFoldedW8A8Linear",
    "RotatedW8A8Linear",
    "RowStableLinear",
    "RowStableRMSNorm",
    "W8A8Linear",
    "rotate_weight",
    "prepare_weights",
    "set_backend",
]
