"""How each W8A8 backend runs, packs, folds and says why it cannot run: the functions behind the
rows of `ops/dispatch.py`'s table (backend modules are imported lazily, on first use)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable

import torch

from quasar_hf.ops.reference import w8a8_linear_reference


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


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


def bind_cpu_fused(weight_q, weight_scale, bias, act_prescale, packed, on_bad_x) -> Callable[[torch.Tensor], torch.Tensor]:
    return cpu_fused_module().bind_linear(weight_q, weight_scale, bias, act_prescale, packed, on_bad_x)


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


# ---- folded forms: an RMSNormOutput (nn/folded_norm.py) -> this linear of it, the norm folded in ----
# `act` offers `quantized_rows()` ((int8 [M, K], fp32 scale [M]) or None) and `fold()` ((x, norm_scale,
# eps) or None). Each form returns None for an act it cannot take (edited, another device, dtype or
# width): the caller then quantizes the norm's output as any other input.


def _takes(x: torch.Tensor, weight_q: torch.Tensor) -> bool:
    return (
        x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and x.device == weight_q.device
        and x.shape[-1] == weight_q.shape[1]
    )


def _from_fold(fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], weight_q: torch.Tensor):
    """folded(act) from fn(x, norm_scale, eps), for backends that quantize the norm's input themselves:
    fn is called only with an x this weight takes, holding at least one row."""

    def folded(act) -> torch.Tensor | None:
        fold = act.fold()
        if fold is None or not _takes(fold[0], weight_q) or fold[0].numel() == 0:
            return None
        return fn(*fold)

    return folded


def folded_reference(weights, packed):
    """From the norm's quantized rows when it made them (the reference's bits either way), else from x."""
    from quasar_hf.ops.reference import w8a8_linear_quantized_reference, w8a8_linear_rmsnorm_reference

    weight_q, weight_scale, bias = weights

    def folded(act) -> torch.Tensor | None:
        rows = act.quantized_rows()
        if rows is not None and rows[0].shape[1] == weight_q.shape[1] and rows[0].device == weight_q.device:
            return w8a8_linear_quantized_reference(act, *rows, weight_q, weight_scale, bias)
        fold = act.fold()
        if fold is None or not _takes(fold[0], weight_q):
            return None
        return w8a8_linear_rmsnorm_reference(*fold, weight_q, weight_scale, bias)

    return folded


def folded_torch(weights, packed):
    """torch sums the norm's squares in its own order, so it always folds from x (never the C rows)."""
    from quasar_hf.ops.cpu import bind_folded_torch

    return _from_fold(bind_folded_torch(weights, packed), weights[0])


def folded_triton(weights, packed):
    from quasar_hf.ops.triton_w8a8 import bind_folded_triton

    return _from_fold(bind_folded_triton(weights), weights[0])


def folded_cpu_fused(weights, packed):
    """The norm's int8 rows through `quasar::w8a8_linear_quantized_cpu_packed` (the GEMM alone); without
    them, x through `quasar::w8a8_folded_norm_linears_cpu_packed` with this one weight (the op a compiled
    step's grouping pass calls with every consumer of a norm). The same bits either way."""
    weight_q, weight_scale, bias = weights
    k = weight_q.shape[1]
    from_rows = torch.ops.quasar.w8a8_linear_quantized_cpu_packed.default
    rows_args = (packed.data, packed.wsum128, weight_scale, bias, packed.out_features)
    from_x = torch.ops.quasar.w8a8_folded_norm_linears_cpu_packed.default
    lists = ([packed.data], [packed.wsum128], [weight_scale], [bias], [packed.out_features], False)

    def folded(act) -> torch.Tensor | None:
        rows = act.quantized_rows()
        if rows is not None and rows[0].shape[1] == k and rows[0].is_cpu:
            return from_rows(act, *rows, *rows_args)
        fold = act.fold()
        if fold is None or not _takes(fold[0], weight_q):
            return None
        x, norm_scale, eps = fold
        return from_x(x, norm_scale, eps, -0.0, *lists)[0]  # norm_scale is offset + weight already: -0.0 + v is v

    return folded
