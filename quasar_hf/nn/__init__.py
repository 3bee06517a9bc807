"""Quantized modules, and the row-stable float linear used for a Quasar model's lm_head."""

from quasar_hf.nn.rowstable_linear import RowStableLinear
from quasar_hf.nn.w8a8_linear import W8A8Linear

__all__ = ["RowStableLinear", "W8A8Linear"]
