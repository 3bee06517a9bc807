"""Sibling W8A8 linears reading one input (q/k/v, gate/up): quantize it once, then one GEMM per weight.

`bind_w8a8_siblings(weights, act_prescale, backend)` returns `linear(x) -> (y_0, y_1, ...)` where
each y_s has the bits of `dispatch.w8a8_linear(x, *weights[s], act_prescale, backend)`: the
per-token quantization is deterministic, so computing it once changes nothing but the cost. On
"cpu_fused" all weights run in one C call (one quantization, one thread team, one ctypes call).
Backends without a shared form ("triton", "bitsandbytes") give None: run the linears one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from quasar_hf.ops import dispatch
from quasar_hf.ops.validation import validate_w8a8_inputs, validate_weights, x_matches

Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # weight_q [N, K], weight_scale [N], bias [N]
SiblingLinear = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def _bind_reference(weights: Sequence[Weights], act_prescale, packed, norm_eps: float | None = None) -> SiblingLinear:
    from quasar_hf.ops.reference import (
        dequantize_epilogue,
        int8_matmul_reference,
        quantize_per_token,
        w8a8_linear_rmsnorm_reference,
    )

    if norm_eps is not None:  # act_prescale is the norm's scale

        def folded(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return tuple(w8a8_linear_rmsnorm_reference(x, act_prescale, norm_eps, w, s, b) for w, s, b in weights)

        return folded

    def linear(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x2 = x.reshape(-1, x.shape[-1])  # [M, K], as w8a8_linear_reference
        if act_prescale is not None:
            x2 = x2.float() * act_prescale
        a_q, a_scale = quantize_per_token(x2)
        return tuple(
            dequantize_epilogue(int8_matmul_reference(a_q, w), a_scale, s, b, x.dtype).reshape(*x.shape[:-1], w.shape[0])
            for w, s, b in weights
        )

    return linear


def _bind_torch(weights: Sequence[Weights], act_prescale, packed) -> SiblingLinear:
    from quasar_hf.ops.cpu import TorchPackedWeight, linear_from_quantized_torch, quantize_activations_torch

    own = [p if isinstance(p, TorchPackedWeight) else None for p in packed]

    def linear(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a_q, a_scale = quantize_activations_torch(x, act_prescale)  # int8 [M, K], fp32 [M, 1]
        lead = x.shape[:-1]
        return tuple(linear_from_quantized_torch(a_q, a_scale, w, s, b, p, x.dtype, lead) for (w, s, b), p in zip(weights, own))

    return linear


def _bind_cpu_fused(weights: Sequence[Weights], act_prescale, packed, norm_eps: float | None = None) -> SiblingLinear:
    from quasar_hf.ops.cpu_fused import PackedWeight
    from quasar_hf.ops.cpu_fused_multi import bind_linear_multi

    own = [p if isinstance(p, PackedWeight) else None for p in packed]

    def bad_x(x: object) -> None:
        validate_w8a8_inputs(x, *weights[0], act_prescale)  # raises the precise error

    return bind_linear_multi(list(weights), act_prescale, own, bad_x, norm_eps=norm_eps)


def _cpu_fused_max_weights() -> int:
    from quasar_hf.ops.cpu_fused_multi import MULTI_MAX

    return MULTI_MAX


# Backends whose shared form can fold an RMSNorm into the quantization (`norm_eps`).
_FOLDS_NORMS = {"cpu_fused", "reference"}

# Backends whose shared form checks x itself (as `x_matches` does, raising through on_bad_x).
_CHECKS_X = {"cpu_fused"}


_SHARED_FORMS: dict[str, Callable[..., SiblingLinear]] = {
    "reference": _bind_reference,
    "torch": _bind_torch,
    "cpu_fused": _bind_cpu_fused,
}


def bind_w8a8_siblings(
    weights: Sequence[Weights],
    act_prescale: torch.Tensor | None = None,
    backend: str = "auto",
    packed: Sequence[object | None] | None = None,
    norm_eps: float | None = None,
) -> SiblingLinear | None:
    """Validate and bind sibling weights once; `linear(x)` quantizes x once and returns every output.

    weights: [(weight_q int8 [N_s, K], weight_scale fp32 [N_s], bias [N_s] or None)], one K and
    one device; act_prescale fp32 [K] or None, shared; packed: each weight's `pack_weight_for`
    result (reused, never copied). None when the backend has no shared form.
    norm_eps: x is an RMSNorm's input whose weight is act_prescale, folded into the quantization
    (`reference.w8a8_linear_rmsnorm_reference`); "cpu_fused" and "reference" have that form (else None).
    """
    if not weights:
        raise ValueError("bind_w8a8_siblings needs at least one weight")
    for w, s, b in weights:
        validate_weights(w, s, b, act_prescale)
    first_q = weights[0][0]
    k, device = first_q.shape[1], first_q.device
    if any(w.shape[1] != k or w.device != device for w, _, _ in weights):
        raise ValueError(
            f"sibling linears must share in_features and device, got {[(tuple(w.shape), str(w.device)) for w, _, _ in weights]}"
        )
    name = dispatch.resolve_backend(backend, device)
    bind = _SHARED_FORMS.get(name)
    if bind is None or (name == "cpu_fused" and len(weights) > _cpu_fused_max_weights()):
        return None
    packs = list(packed) if packed is not None else [None] * len(weights)
    if norm_eps is None:
        shared = bind(weights, act_prescale, packs)
    elif name in _FOLDS_NORMS:
        shared = bind(weights, act_prescale, packs, norm_eps=norm_eps)
    else:
        return None
    if name in _CHECKS_X:
        return shared
    sizes = [w.shape[0] for w, _, _ in weights]

    def linear(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not x_matches(x, k, device):
            validate_w8a8_inputs(x, *weights[0], act_prescale)  # raises the precise error
        if x.numel() == 0:
            return tuple(x.new_zeros(*x.shape[:-1], n) for n in sizes)
        return shared(x)

    return linear
