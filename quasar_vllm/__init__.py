"""A vLLM general plugin: lets vLLM's CPU backend run compressed-tensors input transforms, fast.

vLLM 0.32 applies a stored (non-Sylvester) transform matrix with `dispatch_unquantized_gemm()`, which
on CPU calls `layer.cpu_linear`: an attribute its linear layers get when their weights are packed,
but its `HadamardTransform` module never does, so the first forward fails with "'HadamardTransform'
object has no attribute 'cpu_linear'". Quasar exports its rotated `down_proj` as such a transform
(quasar_hf/export/ct_transforms.py), so this plugin supplies one (`cpu_linear`).

A dense x @ M costs b^2 multiply-adds per row (b = 4864 for Qwen 0.5B's down_proj: 24 M per row
and layer, in bf16, which CPUs without native bf16 emulate at well under 1 GFLOPS). Our matrices
are Kronecker products A (x) B (a Paley matrix of order m, a Sylvester one of order n), so the
plugin finds that split once per module when vLLM prepares its weights (checked exactly; outside
any compiled graph) and `cpu_linear` computes A^T X B in fp32: b (m + n) multiply-adds, then one
rounding to the input dtype. A matrix with no split is applied densely (`F.linear`, as vLLM would).

vLLM finds the plugin through the `vllm.general_plugins` entry point of the quasar-hf distribution
and calls `register()` in every process it starts. Nothing from quasar_hf is imported (vLLM's venv
pins an older Transformers); a vLLM whose `HadamardTransform` has its own `cpu_linear` is left alone.
"""

from __future__ import annotations

import torch


def kronecker_split(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A, B) with matrix == kron(A, B) exactly, A +-1 of the smallest order > 1 that works; or None."""
    b = matrix.shape[0]
    if matrix.dim() != 2 or matrix.shape[1] != b or b < 4 or matrix[0, 0] == 0:
        return None
    for m in range(2, b // 2 + 1):
        if b % m:
            continue
        n = b // m
        blocks = matrix.reshape(m, n, m, n)
        a = blocks[:, 0, :, 0] / matrix[0, 0]  # [m, m], entries the signs of A
        b_factor = blocks[0, :, 0, :]  # [n, n]
        if torch.equal(torch.kron(a, b_factor), matrix):
            return a, b_factor
    return None


def module_split(transform) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A^T fp32 [m, m], B fp32 [n, n]) of the map x -> x M a loaded vLLM `HadamardTransform` applies,
    M = kron(A, B); None where its partitions hold different matrices or M does not split."""
    datas = {p.data.data_ptr(): p.data for p in transform.weight.partitions.values()}
    inverse = {t.args.inverse for t in transform.transforms.values()}
    if len(datas) != 1 or len(inverse) != 1:
        return None
    (stored,) = datas.values()  # vLLM applies x @ stored, or x @ stored^T for an inverse transform
    found = kronecker_split(stored.t() if inverse.pop() else stored)
    return None if found is None else (found[0].float().t().contiguous(), found[1].float().contiguous())


def cpu_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`HadamardTransform.cpu_linear`: F.linear(x, weight, bias), as (A^T X B) per row in fp32 when the
    module's matrix split at load (`_quasar_split`, set by process_weights_after_loading)."""
    split = getattr(self, "_quasar_split", None)
    if split is None or bias is not None:
        return torch.nn.functional.linear(x, weight, bias)
    a_t, b_factor = split
    rows = x.reshape(-1, a_t.shape[0], b_factor.shape[0]).float()  # [R, m, n]
    return (torch.matmul(a_t, rows) @ b_factor).reshape(x.shape).to(x.dtype)


def _with_split(process_weights_after_loading):
    """Wrap vLLM's `HadamardTransform.process_weights_after_loading`: then find the Kronecker split once."""

    def wrapped(self) -> None:
        process_weights_after_loading(self)
        self._quasar_split = module_split(self)

    wrapped.quasar_wrapped = True
    return wrapped


def register() -> None:
    """Give vLLM's `HadamardTransform` a `cpu_linear` on its CPU platform (idempotent)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import HadamardTransform
    except ImportError:  # a vLLM without compressed-tensors transforms: nothing to fill in
        return
    if hasattr(HadamardTransform, "cpu_linear") and not getattr(HadamardTransform.cpu_linear, "quasar", False):
        return  # this vLLM has its own
    cpu_linear.quasar = True
    HadamardTransform.cpu_linear = cpu_linear
    if not getattr(HadamardTransform.process_weights_after_loading, "quasar_wrapped", False):
        HadamardTransform.process_weights_after_loading = _with_split(HadamardTransform.process_weights_after_loading)
