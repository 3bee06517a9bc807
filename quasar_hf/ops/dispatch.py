"""The one dispatch point for W8A8 linears: validate once, pick a backend, call it.

Backends (all compute `ops/reference.py`'s scheme; see each module for its exactness):
  * "reference"    plain PyTorch, the oracle (any device);
  * "torch"        `torch._int_mm` (`ops/cpu.py`; CPU, and CUDA with M padded above 16);
  * "triton"       fused Triton kernel (`ops/triton_w8a8.py`; CUDA, or CPU under TRITON_INTERPRET=1);
  * "bitsandbytes" LLM.int8() primitives (`ops/bnb.py`; close to, not bit-identical with, the reference);
  * "cpu_fused"    fused C/AVX-512-VNNI CPU kernel (`ops/cpu_fused.py`, maintained separately).
"auto": CUDA -> "triton" when importable, else "torch"; CPU -> "cpu_fused" when its
`is_available()` says so, else "torch"; any other device -> "reference".

Backends are imported lazily, so a missing optional package only matters when it is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from quasar_hf.ops.reference import w8a8_linear_reference

BACKENDS = ("reference", "torch", "triton", "bitsandbytes", "cpu_fused")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _device_type(device: str | torch.device | None) -> str:
    """'cpu' / 'cuda' / ... for a device spec; None means the default accelerator if any, else CPU."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def _interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _cpu_fused_module():
    """The fused CPU kernel module if it can be imported (it is optional), else None."""
    try:
        return importlib.import_module("quasar_hf.ops.cpu_fused")
    except ImportError:
        return None


def _unavailable_reason(backend: str, device_type: str) -> str | None:
    """Why `backend` cannot run on `device_type`, or None when it can."""
    if backend == "reference":
        return None
    if backend == "torch":
        if not hasattr(torch, "_int_mm"):
            return "this torch build has no torch._int_mm (needs torch >= 2.2)"
        return None if device_type in ("cpu", "cuda") else f"torch._int_mm does not run on {device_type!r}"
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed (pip install 'quasar-hf[triton]')"
        if device_type == "cuda" or (device_type == "cpu" and _interpret_mode()):
            return None
        return f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests), got {device_type!r}"
    if backend == "bitsandbytes":
        if importlib.util.find_spec("bitsandbytes") is None:
            return "the bitsandbytes package is not installed (pip install 'quasar-hf[bitsandbytes]')"
        return None if device_type in ("cpu", "cuda") else f"bitsandbytes int8 does not run on {device_type!r}"
    if backend == "cpu_fused":
        if device_type != "cpu":
            return f"the fused C kernel runs on CPU tensors only, got {device_type!r}"
        module = _cpu_fused_module()
        if module is None:
            return "quasar_hf.ops.cpu_fused is not importable"
        return None if module.is_available() else "cpu_fused.is_available() is False (no compiler or no AVX-512 VNNI)"
    return f"unknown backend; choose one of {list(BACKENDS)} or 'auto'"


def available_backends(device: str | torch.device | None = None) -> list[str]:
    """Backends that can run on `device` (default: CUDA if present, else CPU), in BACKENDS order."""
    device_type = _device_type(device)
    return [name for name in BACKENDS if _unavailable_reason(name, device_type) is None]


def resolve_backend(backend: str, device: str | torch.device | None) -> str:
    """Concrete backend name for `backend` ("auto" or a name) on `device`; ValueError if it cannot run."""
    device_type = _device_type(device)
    if backend == "auto":
        if device_type == "cuda":
            return "triton" if _unavailable_reason("triton", "cuda") is None else "torch"
        if device_type == "cpu":
            return "cpu_fused" if _unavailable_reason("cpu_fused", "cpu") is None else "torch"
        return "reference"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string such as 'auto' or 'torch', got {type(backend).__name__}")
    reason = _unavailable_reason(backend, device_type)
    if reason is not None:
        raise ValueError(
            f"W8A8 backend {backend!r} is not available on {device_type!r}: {reason}. "
            f"Available here: {available_backends(device_type)} (or 'auto')."
        )
    return backend


def _check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def validate_w8a8_inputs(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    act_prescale: torch.Tensor | None,
) -> None:
    """Raise a ValueError/TypeError naming the offending tensor and the fix; return None if all is well."""
    _check_tensor("x", x)
    _check_tensor("weight_q", weight_q)
    _check_tensor("weight_scale", weight_scale)
    if weight_q.dtype != torch.int8 or weight_q.dim() != 2:
        raise ValueError(
            f"weight_q must be an int8 [out_features, in_features] tensor, got {weight_q.dtype} "
            f"of shape {tuple(weight_q.shape)}; quantize with ops.reference.quantize_weight_per_channel"
        )
    n, k = weight_q.shape
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}; cast it with x.to(torch.bfloat16)")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)} but weight_q expects in_features (last dim of x) = {k}")
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
    tensors = {"x": x, "weight_q": weight_q, "weight_scale": weight_scale, "bias": bias, "act_prescale": act_prescale}
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}; move them with .to(device)")


def _run_backend(name: str, x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    """Call backend `name` (already resolved and available) on validated inputs."""
    if name == "reference":
        return w8a8_linear_reference(x, weight_q, weight_scale, bias, act_prescale)
    if name == "torch":
        from quasar_hf.ops.cpu import TorchPackedWeight, w8a8_linear_torch

        own_packed = packed if isinstance(packed, TorchPackedWeight) else None
        return w8a8_linear_torch(x, weight_q, weight_scale, bias, act_prescale, packed=own_packed)
    if name == "triton":
        from quasar_hf.ops.triton_w8a8 import w8a8_linear_triton

        return w8a8_linear_triton(x, weight_q, weight_scale, bias, act_prescale)
    if name == "bitsandbytes":
        from quasar_hf.ops.bnb import w8a8_linear_bnb

        return w8a8_linear_bnb(x, weight_q, weight_scale, bias, act_prescale)
    module = _cpu_fused_module()  # name == "cpu_fused"
    own_packed = packed if isinstance(packed, module.PackedWeight) else None
    return module.w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias=bias, act_prescale=act_prescale, packed=own_packed)


def w8a8_linear(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
    backend: str = "auto",
    packed: object | None = None,
) -> torch.Tensor:
    """y = W8A8(x): x [..., K] (fp32/bf16/fp16) -> [..., N] in x.dtype.

    weight_q int8 [N, K], weight_scale fp32 [N], bias [N] or None, act_prescale fp32 [K] or None.
    `packed` is an opaque prepacked weight from `pack_weight_for`; a backend uses it only if it
    is of its own kind and ignores it otherwise.
    """
    validate_w8a8_inputs(x, weight_q, weight_scale, bias, act_prescale)
    name = resolve_backend(backend, x.device)
    if x.numel() == 0:  # no rows: nothing to quantize
        return x.new_zeros(*x.shape[:-1], weight_q.shape[0])
    return _run_backend(name, x, weight_q, weight_scale, bias, act_prescale, packed)


def bind_w8a8_linear(
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
    backend: str = "auto",
):
    """Validate the weights, resolve the backend and pack once; return `linear(x)` for these weights.

    The returned function computes exactly `w8a8_linear(x, weight_q, ...)` (same backend, same
    bits) but checks only x per call. Rebind whenever a weight tensor changes (W8A8Linear does).
    """
    k = weight_q.shape[1] if isinstance(weight_q, torch.Tensor) and weight_q.dim() == 2 else 0
    probe = torch.empty(0, k, device=weight_q.device if isinstance(weight_q, torch.Tensor) else None)
    validate_w8a8_inputs(probe, weight_q, weight_scale, bias, act_prescale)
    name = resolve_backend(backend, weight_q.device)
    packed = pack_weight_for(weight_q, name)
    if name == "cpu_fused":
        fast = _cpu_fused_module().bind_linear(weight_q, weight_scale, bias, act_prescale, packed)
    else:

        def fast(x: torch.Tensor) -> torch.Tensor:
            return _run_backend(name, x, weight_q, weight_scale, bias, act_prescale, packed)

    device = weight_q.device

    def linear(x: torch.Tensor) -> torch.Tensor:
        if not (
            isinstance(x, torch.Tensor) and x.dtype in _FLOAT_DTYPES and x.dim() >= 1 and x.shape[-1] == k and x.device == device
        ):
            validate_w8a8_inputs(x, weight_q, weight_scale, bias, act_prescale)  # raises the precise error
        if x.numel() == 0:
            return x.new_zeros(*x.shape[:-1], weight_q.shape[0])
        return fast(x)

    return linear


def pack_weight_for(weight_q: torch.Tensor, backend: str = "auto") -> object | None:
    """Prepacked weight for `backend` on weight_q's device, or None when that backend needs none.

    "torch" on CPU: a contiguous [K, N] copy for M > 1 calls (one extra int8 weight in memory);
    "cpu_fused": whatever that module's packer returns. Call once per weight and pass the result
    to `w8a8_linear(..., packed=...)`.
    """
    name = resolve_backend(backend, weight_q.device)
    if name == "torch" and weight_q.device.type == "cpu":
        from quasar_hf.ops.cpu import prepare_cpu_weight

        return prepare_cpu_weight(weight_q)
    if name == "cpu_fused":
        pack = getattr(_cpu_fused_module(), "pack_weight", None)
        return pack(weight_q) if pack is not None else None
    return None
