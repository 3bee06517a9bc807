"""A vLLM general plugin: lets vLLM's CPU backend run compressed-tensors input transforms.

vLLM 0.32 applies a stored (non-Sylvester) transform matrix with `dispatch_unquantized_gemm()`, which
on CPU calls `layer.cpu_linear`: an attribute its linear layers get when their weights are packed,
but its `HadamardTransform` module never does, so the first forward fails with "'HadamardTransform'
object has no attribute 'cpu_linear'". Quasar exports its rotated `down_proj` as such a transform
(quasar_hf/export/ct_transforms.py). This plugin gives the class a plain `torch.nn.functional.linear`
when, and only when, the installed vLLM lacks one, so a vLLM that fixes it is left as it is.

vLLM finds it through the `vllm.general_plugins` entry point of the quasar-hf distribution and calls
`register()` in every process it starts. It imports nothing from quasar_hf (vLLM's venv pins an
older Transformers).
"""

from __future__ import annotations


def register() -> None:
    """Fill in `HadamardTransform.cpu_linear` on vLLM's CPU platform (idempotent)."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import HadamardTransform
    except ImportError:  # a vLLM without compressed-tensors transforms: nothing to fill in
        return
    if not hasattr(HadamardTransform, "cpu_linear"):
        HadamardTransform.cpu_linear = staticmethod(torch.nn.functional.linear)
