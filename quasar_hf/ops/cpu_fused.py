"""Fused CPU W8A8 linear (AVX-512 VNNI, or AVX2): quantize -> int8 GEMM -> dequantize in one C call.

Why: at decode/verify shapes (M = 1..16 tokens) a W8A8 linear built from torch ops costs about as
much as a BF16 `F.linear`, because each of its ~10 small ops costs several microseconds. One fused
call reads each weight byte once for all rows, so it runs near memory bandwidth with a single
call's overhead. Numerics are exactly those of `ops/reference.py` (bit for bit, tested).

Two C sources, one numerics: `csrc/w8a8_vnni.c` (AVX-512 VNNI) where the CPU has it, else
`csrc/w8a8_avx2.c` (AVX2; AMD Zen 2/3, Intel before Ice Lake), which computes the same bits, so a
checkpoint gives the same logits on either kind of CPU. Both are linked into the quasar:: ops' C++
library (ops/native.py), which picks one at run time; this module packs weights, checks inputs and
calls the ops `quasar::w8a8_linear_cpu_packed` and `quasar::w8a8_folded_norm_linear_cpu_packed`.

Public API (used lazily by `ops/dispatch.py`):
    is_available() -> bool                      never raises
    unavailable_reason() -> str | None          why not, in words
    pack_weight(weight_q) -> PackedWeight       cache it beside the int8 weight
    w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias=None, act_prescale=None, packed=None)
    run_prepacked(...)                          the op call for inputs already checked
    int8_accumulators_cpu_fused(x, weight_q, act_prescale=None, packed=None)   (tests/debug)

Inference only: no autograd. Any M works (row blocks of 6 share each weight chunk in L2); the
kernel is tuned for M <= 16. Threads: torch.get_num_threads() (OpenMP, the same libgomp pool as
torch), at most one per 32 KiB of int8 weight.
"""

from __future__ import annotations

import torch

from quasar_hf.ops import native
from quasar_hf.ops.cpu_packing import PackedWeight, pack_weight, unpack_weight

__all__ = ["PackedWeight", "pack_weight", "unpack_weight"]  # the layout, re-exported beside its kernel
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the dtypes the kernel takes


def unavailable_reason() -> str | None:
    """None when the fused kernel can run here, else why not (missing CPU feature, compiler, build)."""
    return native.unavailable_reason("w8a8")


def is_available() -> bool:
    """True if the CPU has AVX2 (or AVX-512 VNNI) and the kernel built and loaded. Never raises."""
    return unavailable_reason() is None


def kernel_source() -> str | None:
    """The C source of the build in use ('w8a8_vnni.c' or 'w8a8_avx2.c'), None when unavailable."""
    build = native.kernel_builds().get("w8a8")
    return None if build is None or not is_available() else build[1]


# ---- validation -----------------------------------------------------------------------------


def _check_inputs(x, weight_q, weight_scale, bias, act_prescale, packed) -> None:
    """Raise TypeError/ValueError naming the problem and the fix."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPE_CODES:
        raise TypeError(f"x must be a float32/bfloat16/float16 tensor, got {getattr(x, 'dtype', type(x))}")
    if not isinstance(weight_q, torch.Tensor) or weight_q.dtype != torch.int8 or weight_q.dim() != 2:
        raise TypeError("weight_q must be an int8 tensor [out_features, in_features]")
    n, k = weight_q.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1] if x.dim() else 'no'} input features, weight_q expects {k}")
    if k == 0:
        raise ValueError("in_features is 0: a W8A8 linear needs at least one input feature")
    if not isinstance(weight_scale, torch.Tensor) or tuple(weight_scale.shape) != (n,):
        raise ValueError(f"weight_scale must have shape [{n}], got {tuple(getattr(weight_scale, 'shape', ()))}")
    _check_float_vector(weight_scale, "weight_scale")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,) or bias.dtype not in _DTYPE_CODES:
            raise ValueError(f"bias must be a float32/bfloat16/float16 tensor of shape [{n}]")
    if act_prescale is not None:
        if not isinstance(act_prescale, torch.Tensor) or tuple(act_prescale.shape) != (k,):
            raise ValueError(f"act_prescale must have shape [{k}], got {tuple(getattr(act_prescale, 'shape', ()))}")
        _check_float_vector(act_prescale, "act_prescale")
    for name, t in (
        ("x", x),
        ("weight_q", weight_q),
        ("weight_scale", weight_scale),
        ("bias", bias),
        ("act_prescale", act_prescale),
    ):
        if t is not None and not t.is_cpu:
            raise ValueError(f"{name} is on {t.device}; the fused CPU kernel needs CPU tensors")
    if packed is not None:
        if not isinstance(packed, PackedWeight):
            raise TypeError(f"packed must come from pack_weight(), got {type(packed).__name__}")
        if (packed.out_features, packed.in_features) != (n, k):
            raise ValueError(
                f"packed weight is {packed.out_features}x{packed.in_features} but weight_q is "
                f"{n}x{k}; re-run pack_weight(weight_q)"
            )


def _check_float_vector(t: torch.Tensor, name: str) -> None:
    """fp32 (or bf16/fp16, which promote to fp32 exactly as in the reference); never float64."""
    if t.dtype not in _DTYPE_CODES:
        raise TypeError(f"{name} must be float32 (bfloat16/float16 accepted), got {t.dtype}; convert it with .float()")


def _require_kernel() -> None:
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(
            f"the fused CPU W8A8 kernel is unavailable: {reason}. Check cpu_fused.is_available() first, or use the 'torch' backend."
        )


# ---- the call -------------------------------------------------------------------------------


def _op_args(packed: PackedWeight, weight_scale, bias, act_prescale) -> tuple:
    """`quasar::w8a8_linear_cpu_packed`'s arguments after x."""
    return (packed.data, packed.wsum128, weight_scale, bias, act_prescale, packed.out_features)


def w8a8_linear_cpu_fused(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """y = W8A8(x), x [..., K] -> [..., N] in x.dtype; bit-identical to w8a8_linear_reference.

    `packed` (from pack_weight(weight_q)) avoids re-packing the weight on every call.
    """
    _check_inputs(x, weight_q, weight_scale, bias, act_prescale, packed)
    _require_kernel()
    packed = packed if packed is not None else pack_weight(weight_q)
    return torch.ops.quasar.w8a8_linear_cpu_packed.default(x, *_op_args(packed, weight_scale, bias, act_prescale))


def run_prepacked(
    x: torch.Tensor,
    weight_q: torch.Tensor | None,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    act_prescale: torch.Tensor | None,
    packed: PackedWeight,
) -> torch.Tensor:
    """w8a8_linear_cpu_fused without the checks: for callers that validated every input and built
    `packed` with pack_weight(weight_q) themselves (the `quasar::w8a8_linear` op)."""
    return torch.ops.quasar.w8a8_linear_cpu_packed.default(x, *_op_args(packed, weight_scale, bias, act_prescale))


def int8_accumulators_cpu_fused(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    act_prescale: torch.Tensor | None = None,
    packed: PackedWeight | None = None,
) -> torch.Tensor:
    """The kernel's exact int32 accumulators [M, N] for x [..., K] (tests and debugging)."""
    ones = torch.ones(weight_q.shape[0]) if isinstance(weight_q, torch.Tensor) and weight_q.dim() == 2 else None
    _check_inputs(x, weight_q, ones, None, act_prescale, packed)
    _require_kernel()
    packed = packed if packed is not None else pack_weight(weight_q)
    return torch.ops.quasar.w8a8_accumulators_cpu_packed(x, packed.data, packed.wsum128, act_prescale, packed.out_features)
