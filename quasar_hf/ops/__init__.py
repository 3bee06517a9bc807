"""W8A8 numerics: the reference oracle and the kernel backends behind one dispatch point."""

from quasar_hf.ops.dispatch import BACKENDS, available_backends, pack_weight_for, resolve_backend, w8a8_linear
from quasar_hf.ops.reference import quantize_per_token, quantize_weight_per_channel, w8a8_linear_reference

__all__ = [
    "BACKENDS",
    "available_backends",
    "pack_weight_for",
    "quantize_per_token",
    "quantize_weight_per_channel",
    "resolve_backend",
    "w8a8_linear",
    "w8a8_linear_reference",
]
