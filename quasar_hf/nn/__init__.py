"""Quantized modules."""

from quasar_hf.nn.w8a8_linear import W8A8Linear

__all__ = ["W8A8Linear"]
