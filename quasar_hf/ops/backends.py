"""How each W8A8 backend runs, packs, folds and says why it cannot run: the functions behind the
rows of `ops/dispatch.py`'s table (backend modules are imported lazily, on first use)."""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from quasar_hf.ops.reference import w8a8_linear_reference
from quasar_hf.ops.triton_settings import interpret_mode


@functools.cache
def cpu_fused_module():
    """The fused CPU kernel module if it can be imported (it is optional), else None (looked up once:
    the compiled linear op asks on every call)."""
    try:
        return importlib.import_module("quasar_hf.ops.cpu_fused")
    except ImportError:
        return None


# ---- why each backend cannot run on a device type (None: it can) ----------------------------


def reference_unavailable(device_type: str) -> str | None:
    return None


def torch_unavailable(device_type: str) -> str | None:
    if not hasattr(torch, "_int_mm"):
        return "this torch build has no torch._int_mm (needs torch >= 2.2)"
    return None if device_type in ("cpu", "cuda") else f"torch._int_mm does not run on {device_type!r}"


def triton_unavailable(device_type: str) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install 'quasar-hf[triton]')"
    if device_type == "cuda" or (device_type == "cpu" and interpret_mode()):
        return None
    return f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests), got {device_type!r}"


def bnb_unavailable(device_type: str) -> str | None:
    if importlib.util.find_spec("bitsandbytes") is None:
        return "the bitsandbytes package is not installed (pip install 'quasar-hf[bitsandbytes]')"
    return None if device_type in ("cpu", "cuda") else f"bitsandbytes int8 does not run on {device_type!r}"


def cpu_fused_unavailable(device_type: str) -> str | None:
    if device_type != "cpu":
        return f"the fused C kernel runs on CPU tensors only, got {device_type!r}"
    module = cpu_fused_module()
    if module is None:
        return "quasar_hf.ops.cpu_fused is not importable"
    return module.unavailable_reason()


# ---- how each backend runs (inputs validated; `packed` used only if it is the backend's own) ---


def run_reference(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    return w8a8_linear_reference(x, weight_q, weight_scale, bias, act_prescale)


def run_torch(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    from quasar_hf.ops.cpu import TorchPackedWeight, w8a8_linear_torch

    own = packed if isinstance(packed, TorchPackedWeight) else None
    return w8a8_linear_torch(x, weight_q, weight_scale, bias, act_prescale, packed=own)


def run_triton(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    from quasar_hf.ops.triton_w8a8 import w8a8_linear_triton

    return w8a8_linear_triton(x, weight_q, weight_scale, bias, act_prescale)


def run_bnb(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    from quasar_hf.ops.bnb import w8a8_linear_bnb

    return w8a8_linear_bnb(x, weight_q, weight_scale, bias, act_prescale)


def run_cpu_fused(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    module = cpu_fused_module()
    own = packed if isinstance(packed, module.PackedWeight) else None
    return module.w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias=bias, act_prescale=act_prescale, packed=own)


def pack_torch(weight_q: torch.Tensor) -> object | None:
    from quasar_hf.ops.cpu import prepare_cpu_weight

    return prepare_cpu_weight(weight_q) if weight_q.device.type == "cpu" else None


def pack_cpu_fused(weight_q: torch.Tensor) -> object | None:
    return cpu_fused_module().pack_weight(weight_q)


def run_cpu_fused_prepacked(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    return cpu_fused_module().run_prepacked(x, weight_q, weight_scale, bias, act_prescale, packed)


def op_call_cpu_fused(weights: tuple, packed) -> tuple[str, tuple]:
    """`quasar::w8a8_linear_cpu_packed` and its arguments after x: only what the kernel reads."""
    weight_q, weight_scale, bias, act_prescale = weights
    return "w8a8_linear_cpu_packed", (packed.data, packed.wsum128, weight_scale, bias, act_prescale, weight_q.shape[0])


def packed_tensors_cpu_fused(packed) -> tuple[torch.Tensor, ...]:
    return (packed.data, packed.wsum128)


def unpack_cpu_fused(weight_q: torch.Tensor, tensors: list[torch.Tensor]) -> object:
    n, k = weight_q.shape
    return cpu_fused_module().PackedWeight(tensors[0], tensors[1], n, k)


def packed_tensors_torch(packed) -> tuple[torch.Tensor, ...]:
    return (packed.weight_kn,)


def unpack_torch(weight_q: torch.Tensor, tensors: list[torch.Tensor]) -> object:
    from quasar_hf.ops.cpu import TorchPackedWeight

    return TorchPackedWeight(weight_kn=tensors[0])


# ---- folded forms: W8A8(RMSNorm(x)) with the norm folded into the activation quantization --------
# run_folded_*(x, norm_scale, eps, weight_q, weight_scale, bias, packed) -> [..., N]: norm_scale is the
# norm's fp32 (offset + weight) [K]; the bits of reference.w8a8_linear_rmsnorm_reference (torch: with
# torch's own row sum). `quasar::w8a8_folded_norm_linear` calls them (ops/torch_ops.py).


def run_folded_reference(x, norm_scale, eps, weight_q, weight_scale, bias, packed):
    from quasar_hf.ops.reference import w8a8_linear_rmsnorm_reference

    return w8a8_linear_rmsnorm_reference(x, norm_scale, eps, weight_q, weight_scale, bias)


def run_folded_torch(x, norm_scale, eps, weight_q, weight_scale, bias, packed):
    """torch sums the norm's squares in its own order (rms_factor_torch)."""
    from quasar_hf.ops.cpu import bind_folded_torch

    return bind_folded_torch((weight_q, weight_scale, bias), packed)(x, norm_scale, eps)


def run_folded_triton(x, norm_scale, eps, weight_q, weight_scale, bias, packed):
    from quasar_hf.ops.triton_w8a8 import bind_folded_triton

    return bind_folded_triton((weight_q, weight_scale, bias))(x, norm_scale, eps)


def fold_op_cpu_fused(weights: tuple, packed) -> tuple[str, tuple]:
    """The folded linear on the packed layout: `quasar::w8a8_folded_norm_linear_cpu_packed`."""
    _, weight_scale, bias, _ = weights
    return "w8a8_folded_norm_linear_cpu_packed", (packed.data, packed.wsum128, weight_scale, bias, packed.out_features)
