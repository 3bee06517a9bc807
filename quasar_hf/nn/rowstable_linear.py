"""RowStableLinear: an nn.Linear whose every output row is the same whatever the number of rows.

A Quasar model's lm_head stays in its float dtype (it is tied to the embeddings and its error
reaches the logits directly). Replaced by this module, a k-token verify step produces logits
bit-identical to k one-token decode steps on CPU (the op `quasar::rowstable_linear`, eager and
compiled alike: its C kernel, `ops/rowstable_linear.py`), so greedy `quasar=True` equals plain
greedy decoding even at near-ties. The module holds the very same Parameters as the Linear it
replaces (ties, state dict keys and checkpoints are unchanged). Compiled with gradients, and
elsewhere (CUDA, float16), it is `F.linear`. Eager with autograd on, the forward has the same bits and the
backward is the plain linear's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quasar_hf.ops import rowstable_linear as kernel


class RowStableLinear(nn.Linear):
    """nn.Linear computed by the row-stable CPU kernel where it applies (inference on CPU, fp32/bf16)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> RowStableLinear:
        """A RowStableLinear sharing `linear`'s weight and bias Parameters (no copy)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"RowStableLinear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight = linear.weight
        module.bias = linear.bias
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if torch.compiler.is_compiling():
            if _needs_grad(x, self.weight, self.bias):  # the op has no autograd formula: train through F.linear
                return F.linear(x, self.weight, self.bias)
            if kernel.fits(x, self.weight, self.bias) and kernel.available_when_compiled():
                return torch.ops.quasar.rowstable_linear(x, self.weight, self.bias)
            return F.linear(x, self.weight, self.bias)
        if not kernel.supports(x, self.weight, self.bias):
            return F.linear(x, self.weight, self.bias)
        if _needs_grad(x, self.weight, self.bias):
            return _RowStableLinearFunction.apply(x, self.weight, self.bias)
        return torch.ops.quasar.rowstable_linear(x, self.weight, self.bias)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _RowStableLinearFunction(torch.autograd.Function):
    """The kernel's forward with a linear's gradients (so the bits never depend on grad mode)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.ops.quasar.rowstable_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        flat_grad, flat_x = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_w = flat_grad.T @ flat_x if ctx.needs_input_grad[1] else None
        grad_b = flat_grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b
