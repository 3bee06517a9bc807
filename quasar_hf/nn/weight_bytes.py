"""What a model's weights weigh: a module's bytes, and the bytes one decode step must read.

A decode step multiplies by every linear's weight once: the int8 weight of each W8A8 linear (a
norm-folded group's stacked weight counts once) and the weight of each linear left in float (the
lm_head, and any kept in float), in its dtype. That sum over the read bandwidth is the floor a step
is measured against. The embedding table is not read whole (a step gathers a few rows) and norms,
scales and biases are left out (well under 1 % of the bytes).
"""

from __future__ import annotations

from torch import nn

from quasar_hf.nn.w8a8_linear import W8A8Linear


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (a shared parameter once): what it holds in memory."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def step_weight_bytes(model: nn.Module) -> dict[str, int]:
    """{"int8": bytes of every W8A8 linear's int8 weight, "float": bytes of every float linear's weight
    (the lm_head included)}: the weights one decode step reads."""
    int8 = float_bytes = 0
    for module in model.modules():
        if isinstance(module, W8A8Linear):
            int8 += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, nn.Linear):
            float_bytes += module.weight.numel() * module.weight.element_size()
    return {"int8": int8, "float": float_bytes}


def step_read_bytes(model: nn.Module) -> int:
    """Bytes one decode step must read (`step_weight_bytes`, summed): the numerator of its floor."""
    return sum(step_weight_bytes(model).values())
