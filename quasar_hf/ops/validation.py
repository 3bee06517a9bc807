"""Input checks for the W8A8 linear: one place, errors that name the tensor and the fix."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def validate_weights(
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    act_prescale: torch.Tensor | None,
) -> None:
    """Raise a ValueError/TypeError naming the offending weight-side tensor and the fix."""
    _check_tensor("weight_q", weight_q)
    _check_tensor("weight_scale", weight_scale)
    if weight_q.dtype != torch.int8 or weight_q.dim() != 2:
        raise ValueError(
            f"weight_q must be an int8 [out_features, in_features] tensor, got {weight_q.dtype} "
            f"of shape {tuple(weight_q.shape)}; quantize with ops.reference.quantize_weight_per_channel"
        )
    n, k = weight_q.shape
    if k == 0:
        raise ValueError("in_features is 0: a W8A8 linear needs at least one input feature")
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,):
        raise ValueError(
            f"weight_scale must be float32 of shape ({n},) (one scale per output channel), "
            f"got {weight_scale.dtype} of shape {tuple(weight_scale.shape)}"
        )
    if bias is not None:
        _check_tensor("bias", bias)
        if not bias.is_floating_point() or tuple(bias.shape) != (n,):
            raise ValueError(f"bias must be a float tensor of shape ({n},), got {bias.dtype} of shape {tuple(bias.shape)}")
    if act_prescale is not None:
        _check_tensor("act_prescale", act_prescale)
        if act_prescale.dtype != torch.float32 or tuple(act_prescale.shape) != (k,):
            raise ValueError(
                f"act_prescale must be float32 of shape ({k},) (one factor per input channel), "
                f"got {act_prescale.dtype} of shape {tuple(act_prescale.shape)}"
            )
    tensors = {"weight_q": weight_q, "weight_scale": weight_scale, "bias": bias, "act_prescale": act_prescale}
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}; move them with .to(device)")


def validate_w8a8_inputs(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    act_prescale: torch.Tensor | None,
) -> None:
    """Raise a ValueError/TypeError naming the offending tensor and the fix; return None if all is well."""
    _check_tensor("x", x)
    validate_weights(weight_q, weight_scale, bias, act_prescale)
    k = weight_q.shape[1]
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}; cast it with x.to(torch.bfloat16)")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)} but weight_q expects in_features (last dim of x) = {k}")
    if x.device != weight_q.device:
        raise ValueError(
            f"all tensors must be on one device, got x on {x.device} and weight_q on {weight_q.device}; "
            "move them with .to(device)"
        )


def is_bound_linear_input(x: object, k: int, device: torch.device) -> bool:
    """The cheap per-call check of a bound linear: a float tensor [..., k] on `device`."""
    return isinstance(x, torch.Tensor) and x.dtype in FLOAT_DTYPES and x.dim() >= 1 and x.shape[-1] == k and x.device == device
