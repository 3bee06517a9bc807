"""W8A8 numerics and row-stable attention: the reference oracles, the kernels, one dispatch table."""

from quasar_hf.ops import torch_ops  # noqa: F401 - registers torch.ops.quasar.* (the kernels as operators)
from quasar_hf.ops.backend_report import backend_report
from quasar_hf.ops.dispatch import BACKENDS, available_backends, pack_weight_for, resolve_backend, w8a8_linear
from quasar_hf.ops.reference import quantize_per_token, quantize_weight_per_channel, w8a8_linear_reference

__all__ = [
    "BACKENDS",
    "available_backends",
    "backend_report",
    "pack_weight_for",
    "quantize_per_token",
    "quantize_weight_per_channel",
    "resolve_backend",
    "w8a8_linear",
    "w8a8_linear_reference",
]
