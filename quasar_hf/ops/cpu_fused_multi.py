"""One fused CPU W8A8 call over several weights that read one input (q/k/v, gate/up).

`bind_linear_multi(weights, act_prescale, packed)` -> `linear(x) -> (y_0, y_1, ...)`: x is
quantized once and every weight's GEMM runs in the same C call (`qhf_w8a8_linear_multi` in
csrc/w8a8_vnni.c; the threads split all weights' channel blocks as one range). Each y_s has the
bits of `cpu_fused.w8a8_linear_cpu_fused(x, *weights[s], act_prescale=act_prescale)`. With norm_eps,
x is an RMSNorm's input folded into that quantization, and the call can also write the norm's
output (what a FoldedRMSNorm returns; nn/folded_norm.py).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable

import torch

from quasar_hf.ops.cpu_fused import (
    _DTYPE_CODES,
    _I64,
    _INT,
    _MIN_BYTES_PER_THREAD,
    _P,
    PackedWeight,
    _bad_x,
    _check_inputs,
    _fp32_contiguous,
    _library,
    _require_library,
    _storages,
    pack_weight,
)

MULTI_MAX = 8  # weights per `qhf_w8a8_linear_multi` call (MULTI_MAX in csrc/qhf_entry_points.h)


class _CWeight(ctypes.Structure):
    """One weight of `qhf_w8a8_linear_multi` (the C struct `qhf_weight`, csrc/qhf_entry_points.h)."""

    _fields_ = [("w_packed", _P), ("wsum128", _P), ("w_scale", _P), ("bias", _P), ("bias_dtype", _I64), ("n", _I64)]


@functools.lru_cache(maxsize=1)
def _multi_entry():
    """`qhf_w8a8_linear_multi` from the library cpu_fused built and checked (raises if unavailable)."""
    _require_library()
    fn = _library().lib.qhf_w8a8_linear_multi
    fn.restype = _INT
    fn.argtypes = [_P, _INT, _I64, _I64, _I64, _P, ctypes.c_float, _P, _I64, _INT, ctypes.POINTER(_CWeight), _P, _INT, _INT]
    return fn


def bind_linear_multi(
    weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    act_prescale: torch.Tensor | None = None,
    packed: list[PackedWeight | None] | None = None,
    on_bad_x: Callable[[torch.Tensor], None] | None = None,
    norm_eps: float | None = None,
    emit_normed: bool = False,
):
    """Several weights reading one input (q/k/v, gate/up): `linear(x) -> (y_0, y_1, ...)`, one C call.

    weights: [(weight_q [N_s, K], weight_scale [N_s], bias [N_s] or None)], one K, at most MULTI_MAX;
    `packed` their pack_weight() results (None: packed here). x is quantized once; each y_s has the
    bits of w8a8_linear_cpu_fused(x, *weights[s], act_prescale=act_prescale). Checks x only per
    call; `on_bad_x` as in bind_linear.

    norm_eps: x is an RMSNorm's input, folded into the quantization: act_prescale is then the norm's
    weight and each row's epilogue scale carries 1 / sqrt(mean(x^2) + norm_eps)
    (reference.w8a8_linear_rmsnorm_reference is the oracle, bit for bit). emit_normed (with norm_eps):
    `linear(x)` returns (normed, y_0, y_1, ...), normed [..., K] the norm's output in x.dtype, written by
    the same call (reference.rmsnorm_reference, bit for bit).
    """
    if not 1 <= len(weights) <= MULTI_MAX:
        raise ValueError(f"bind_linear_multi takes 1 to {MULTI_MAX} weights, got {len(weights)}")
    k = weights[0][0].shape[1] if isinstance(weights[0][0], torch.Tensor) and weights[0][0].dim() == 2 else 0
    packs = list(packed) if packed is not None else [None] * len(weights)
    structs = (_CWeight * len(weights))()
    held = []  # every tensor the C structs point into stays alive with `linear`
    for s, ((weight_q, weight_scale, bias), pack) in enumerate(zip(weights, packs, strict=True)):
        _check_inputs(torch.empty(0, k), weight_q, weight_scale, bias, act_prescale, pack)
        pack = pack if pack is not None else pack_weight(weight_q)
        w_scale = _fp32_contiguous(weight_scale)
        bias_c = bias if bias is None or bias.is_contiguous() else bias.contiguous()
        held += [pack, w_scale, bias_c]
        structs[s] = _CWeight(
            pack.data.data_ptr(),
            pack.wsum128.data_ptr(),
            w_scale.data_ptr(),
            None if bias_c is None else bias_c.data_ptr(),
            0 if bias_c is None else _DTYPE_CODES[bias_c.dtype],
            weight_q.shape[0],
        )
    multi = _multi_entry()
    prescale = None if act_prescale is None else _fp32_contiguous(act_prescale)
    prescale_ptr = None if prescale is None else prescale.data_ptr()
    eps = -1.0 if norm_eps is None else float(norm_eps)
    if norm_eps is not None and not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"norm_eps must be a finite number >= 0, got {norm_eps!r}")
    if emit_normed and norm_eps is None:
        raise ValueError("emit_normed needs norm_eps: only a folded norm has an output of its own")
    sizes = tuple(w[0].shape[0] for w in weights)
    k_padded, count = held[0].data.shape[1] * 4, len(weights)
    max_threads = max(1, sum(sizes) * k // _MIN_BYTES_PER_THREAD)
    first = weights[0]

    def linear(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not (isinstance(x, torch.Tensor) and x.dtype in _DTYPE_CODES and x.dim() >= 1 and x.shape[-1] == k and x.is_cpu):
            _bad_x(x, on_bad_x, *first, act_prescale)
        x2 = x if x.dim() == 2 else x.reshape(-1, k)  # [M, K]
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        lead, code = x.shape[:-1], _DTYPE_CODES[x.dtype]
        outs = tuple(torch.empty((*lead, n), dtype=x.dtype) for n in sizes)  # [..., N_s]
        normed = torch.empty((*lead, k), dtype=x.dtype) if emit_normed else None  # [..., K]
        if emit_normed:
            outs = (normed, *outs)
        if x2.shape[0] == 0:
            return outs
        pointers = (_P * count)(*(y.data_ptr() for y in outs[emit_normed:]))
        status = multi(
            x2.data_ptr(),
            code,
            x2.shape[0],
            k,
            x2.stride(0),
            prescale_ptr,
            eps,
            None if normed is None else normed.data_ptr(),
            k_padded,
            count,
            structs,
            pointers,
            code,
            min(torch.get_num_threads(), max_threads),
        )
        if status != 0:
            raise MemoryError(f"fused W8A8 kernel could not allocate scratch for {x2.shape[0]}x{k} activations")
        return outs

    linear.kernel_storages = _storages(*held, prescale)
    return linear


def folded_linears_prepacked(
    x: torch.Tensor,
    weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    packed: list[PackedWeight],
    norm_scale: torch.Tensor,
    norm_eps: float,
    emit_normed: bool = False,
) -> tuple[torch.Tensor, ...]:
    """(y_0, y_1, ...) of linears reading RMSNorm(x), the norm folded into x's quantization, in one C
    call: the bits of `bind_linear_multi(weights, norm_scale, packed, norm_eps=norm_eps, emit_normed=...)(x)`
    (with emit_normed, the norm's own output first).

    Per call and without checks, for the `quasar::w8a8_folded_norm_linears_cpu_packed` op's fallback,
    whose fake validated the shapes when the step was traced: x a CPU float tensor [..., K]; weights
    [(int8 [N_s, K] or None, scale [N_s], bias [N_s] or None)], at most MULTI_MAX; packed their
    pack_weight() (the sizes come from them); norm_scale fp32 [K] contiguous (the norm's weight, or 1 + weight).
    """
    k = x.shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)  # [M, K]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    lead, code = x.shape[:-1], _DTYPE_CODES[x.dtype]
    outs = tuple(torch.empty((*lead, p.out_features), dtype=x.dtype) for p in packed)  # [..., N_s]
    normed = torch.empty((*lead, k), dtype=x.dtype) if emit_normed else None  # [..., K]
    if x2.shape[0] == 0:
        return outs if normed is None else (normed, *outs)
    structs = (_CWeight * len(weights))()
    held = []  # what the structs point into, alive until the call returns
    for s, ((_, weight_scale, bias), pack) in enumerate(zip(weights, packed, strict=True)):
        w_scale = _fp32_contiguous(weight_scale)
        bias_c = bias if bias is None or bias.is_contiguous() else bias.contiguous()
        held.append((w_scale, bias_c))
        bias_ptr, bias_code = (None, 0) if bias_c is None else (bias_c.data_ptr(), _DTYPE_CODES[bias_c.dtype])
        structs[s] = _CWeight(
            pack.data.data_ptr(), pack.wsum128.data_ptr(), w_scale.data_ptr(), bias_ptr, bias_code, pack.out_features
        )
    threads = max(1, min(torch.get_num_threads(), sum(y.shape[-1] for y in outs) * k // _MIN_BYTES_PER_THREAD))
    pointers = (_P * len(outs))(*(y.data_ptr() for y in outs))
    status = _multi_entry()(
        x2.data_ptr(), code, x2.shape[0], k, x2.stride(0), norm_scale.data_ptr(), float(norm_eps),
        None if normed is None else normed.data_ptr(), packed[0].data.shape[1] * 4, len(weights), structs, pointers,
        code, threads,
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"fused W8A8 kernel could not allocate scratch for {x2.shape[0]}x{k} activations")
    return outs if normed is None else (normed, *outs)
