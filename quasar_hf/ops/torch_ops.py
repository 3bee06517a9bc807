"""The kernels as PyTorch operators (`torch.ops.quasar.*`) with fake implementations, so
`torch.compile` traces a Quasar model: each kernel is one opaque node whose output shape the
fake implementation gives, and Inductor calls the real kernel at run time.

  quasar::w8a8_linear(x, weight_q, weight_scale, bias?, act_prescale?, packed[], backend) -> [..., N]
  quasar::rowstable_attention_cpu(query, key, value, visible?, scale?) -> [B, Q, H, D]
  quasar::rowstable_attention_triton(query, key, value, visible?, scale?) -> [B, Q, H, D]
  quasar::rowstable_linear(x, weight, bias?) -> [..., N]   (the float lm_head, RowStableLinear)
  quasar::hadamard_rows(x, signs?, blocks, odd_order, pow2) -> fp32 [..., K]   (RotatedW8A8Linear's input)
  quasar::rms_norm(x, weight, eps, offset, scale_in_float) -> [..., K]   (every RMSNorm when compiled;
      on CPU the row-stable C kernel of rms_norm_cpu.py, not the Transformers formula's bits)
  quasar::w8a8_folded_norm_linears(x, norm_weight, eps, offset, weight_q[], weight_scale[], bias?[],
      packed[], backend) -> [y_0, y_1, ...]   (what a compiled FoldedRMSNorm and its consumers become:
      written by ops/graph_passes.py, never by model code; "cpu_fused" only)

Registered with `torch.library.Library` (define + impl + `register_fake`) rather than the
`torch.library.custom_op` decorator: both give the same operator, but the decorator's Python
wrapper (autograd and aliasing checks) costs ~20 us per call against ~4 us here, and a compiled
SmolLM2 verify step calls the linear op 210 times. Eager code never goes through these ops: the
public functions call the kernels directly and switch to the op only while `torch.compile`
traces (`torch.compiler.is_compiling()`), so eager per-call cost is unchanged.

The linear op takes the weight's packed layout as tensors (`PreparedW8A8.packed_tensors`, made once
when the module is prepared) and the resolved backend, so a compiled graph neither repacks nor
looks anything up per call; with no packed tensors (the functional `w8a8_linear` traced) it packs
per call. Inference only: no autograd formulas.
"""

from __future__ import annotations

import functools

import torch

from quasar_hf.ops import dispatch
from quasar_hf.ops.validation import is_bound_linear_input, validate_w8a8_inputs

_LIB = torch.library.Library("quasar", "DEF")
_LIB.define(
    "w8a8_linear(Tensor x, Tensor weight_q, Tensor weight_scale, Tensor? bias, Tensor? act_prescale, Tensor[] packed, "
    "str backend) -> Tensor"
)
_LIB.define("rowstable_attention_cpu(Tensor query, Tensor key, Tensor value, Tensor? visible, float? scale) -> Tensor")
_LIB.define("rowstable_attention_triton(Tensor query, Tensor key, Tensor value, Tensor? visible, float? scale) -> Tensor")
_LIB.define("rowstable_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.define("hadamard_rows(Tensor x, Tensor? signs, int blocks, int odd_order, int pow2) -> Tensor")
_LIB.define("rms_norm(Tensor x, Tensor weight, float eps, float offset, bool scale_in_float) -> Tensor")
_LIB.define(
    "w8a8_folded_norm_linears(Tensor x, Tensor norm_weight, float eps, float offset, Tensor[] weight_q, "
    "Tensor[] weight_scale, Tensor?[] bias, Tensor[] packed, str backend) -> Tensor[]"
)


# ---- quasar::w8a8_linear -------------------------------------------------------------------


def _w8a8_linear_impl(x, weight_q, weight_scale, bias, act_prescale, packed: list, backend: str) -> torch.Tensor:
    if not is_bound_linear_input(x, weight_q.shape[1], weight_q.device):
        validate_w8a8_inputs(x, weight_q, weight_scale, bias, act_prescale)  # raises the precise error
    if x.numel() == 0:
        return x.new_zeros(*x.shape[:-1], weight_q.shape[0])
    entry = dispatch.backend_entry(backend)
    if packed and entry.unpack is not None:
        return entry.run_prepacked(x, weight_q, weight_scale, bias, act_prescale, entry.unpack(weight_q, packed))
    return entry.run(x, weight_q, weight_scale, bias, act_prescale, None)


def _w8a8_linear_fake(x, weight_q, weight_scale, bias, act_prescale, packed: list, backend: str) -> torch.Tensor:
    validate_w8a8_inputs(x, weight_q, weight_scale, bias, act_prescale)  # at trace time: the same errors as eager
    return x.new_empty(*x.shape[:-1], weight_q.shape[0])


_LIB.impl("w8a8_linear", _w8a8_linear_impl, "CompositeExplicitAutograd")
torch.library.register_fake("quasar::w8a8_linear", _w8a8_linear_fake, lib=_LIB)


# ---- row-stable attention ------------------------------------------------------------------


def _attention_fake(query, key, value, visible, scale) -> torch.Tensor:
    batch, heads, q_len, head_dim = query.shape
    return query.new_empty(batch, q_len, heads, head_dim)


def _attention_cpu_impl(query, key, value, visible, scale) -> torch.Tensor:
    from quasar_hf.ops import attention_cpu

    return attention_cpu._rowstable_attention(query, key, value, visible, scale)


def _attention_triton_impl(query, key, value, visible, scale) -> torch.Tensor:
    from quasar_hf.ops import triton_attention

    return triton_attention._rowstable_attention_triton(query, key, value, visible, scale)


_LIB.impl("rowstable_attention_cpu", _attention_cpu_impl, "CompositeExplicitAutograd")
_LIB.impl("rowstable_attention_triton", _attention_triton_impl, "CompositeExplicitAutograd")
torch.library.register_fake("quasar::rowstable_attention_cpu", _attention_fake, lib=_LIB)
torch.library.register_fake("quasar::rowstable_attention_triton", _attention_fake, lib=_LIB)


# ---- row-stable float linear (the lm_head) -------------------------------------------------


def _rowstable_linear_impl(x, weight, bias) -> torch.Tensor:
    from quasar_hf.ops import rowstable_linear

    return rowstable_linear.rowstable_linear(x, weight, bias)


def _rowstable_linear_fake(x, weight, bias) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_LIB.impl("rowstable_linear", _rowstable_linear_impl, "CompositeExplicitAutograd")
torch.library.register_fake("quasar::rowstable_linear", _rowstable_linear_fake, lib=_LIB)


# ---- Hadamard rotation of activation rows (RotatedW8A8Linear) --------------------------------


@functools.lru_cache(maxsize=64)
def _bound_rotation(size: int, blocks: int, odd_order: int, pow2: int):
    """The rotation's kernel call with its signs and sizes looked up once (a memo of a pure function)."""
    from quasar_hf.ops import hadamard, hadamard_cpu

    return hadamard_cpu.bind_rotation(hadamard.HadamardRotation(size, blocks, odd_order, pow2))


def _hadamard_rows_impl(x, signs, blocks: int, odd_order: int, pow2: int) -> torch.Tensor:
    """x Q (ops/hadamard.py). `signs` (H_m, fp32 [m, m], or None) is what the native twin reads
    (ops/native.py); this op's memo holds the same matrix, so it reads its own."""
    return _bound_rotation(x.shape[-1], blocks, odd_order, pow2)(x)


def _hadamard_rows_fake(x, signs, blocks: int, odd_order: int, pow2: int) -> torch.Tensor:
    if x.shape[-1] != blocks * odd_order * pow2:
        raise ValueError(f"hadamard_rows: rows of {x.shape[-1]} do not match {blocks} x {odd_order} x {pow2}")
    if signs is not None and (tuple(signs.shape) != (odd_order, odd_order) or signs.dtype != torch.float32):
        raise ValueError(f"hadamard_rows: signs must be fp32 [{odd_order}, {odd_order}], got {tuple(signs.shape)} {signs.dtype}")
    return x.new_empty(x.shape, dtype=torch.float32)


_LIB.impl("hadamard_rows", _hadamard_rows_impl, "CompositeExplicitAutograd")
torch.library.register_fake("quasar::hadamard_rows", _hadamard_rows_fake, lib=_LIB)


# ---- RMSNorm (RowStableRMSNorm, FoldedRMSNorm under compile) ---------------------------------


def _rms_norm_impl(x, weight, eps: float, offset: float, scale_in_float: bool) -> torch.Tensor:
    """CPU: the row-stable C kernel (rms_norm_cpu.py); elsewhere the Transformers formula. Contiguous,
    as the fake says (Gemma's q/k norms read transposed views)."""
    from quasar_hf.ops import rms_norm_cpu
    from quasar_hf.ops.reference import transformers_rms_norm_reference

    if x.device.type == "cpu":
        return rms_norm_cpu.rms_norm_rows(x, weight, eps, offset, scale_in_float)
    return transformers_rms_norm_reference(x, weight, eps, offset, scale_in_float).contiguous()


def _rms_norm_fake(x, weight, eps: float, offset: float, scale_in_float: bool) -> torch.Tensor:
    dtype = x.dtype if scale_in_float else torch.promote_types(weight.dtype, x.dtype)
    return x.new_empty(x.shape, dtype=dtype)


_LIB.impl("rms_norm", _rms_norm_impl, "CompositeExplicitAutograd")
torch.library.register_fake("quasar::rms_norm", _rms_norm_fake, lib=_LIB)


# ---- an RMSNorm folded into the W8A8 linears it feeds (written by ops/graph_passes.py) -------


def _split_packed(weight_q: list, packed: list) -> list[list]:
    """The flat `packed` list as one list per weight (each weight packs into the same number of tensors)."""
    per = len(packed) // len(weight_q) if weight_q else 0
    if per == 0 or per * len(weight_q) != len(packed):
        raise ValueError(f"w8a8_folded_norm_linears: {len(packed)} packed tensors do not split over {len(weight_q)} weights")
    return [packed[i * per : (i + 1) * per] for i in range(len(weight_q))]


def _folded_norm_linears_checked(x, norm_weight, weight_q, weight_scale, bias, packed, backend: str) -> None:
    """The errors eager would raise (at trace time, through the fake), plus this op's own limits."""
    from quasar_hf.ops.cpu_fused_multi import MULTI_MAX

    if backend != "cpu_fused":
        raise ValueError(f"w8a8_folded_norm_linears runs on the 'cpu_fused' backend only, got {backend!r}")
    if not 1 <= len(weight_q) <= MULTI_MAX or not len(weight_q) == len(weight_scale) == len(bias):
        raise ValueError(f"w8a8_folded_norm_linears takes 1 to {MULTI_MAX} weights with one scale and bias (or None) each")
    for w, s, b in zip(weight_q, weight_scale, bias):
        validate_w8a8_inputs(x, w, s, b, None)
    if tuple(norm_weight.shape) != (x.shape[-1],):
        raise ValueError(f"w8a8_folded_norm_linears: norm weight {tuple(norm_weight.shape)} does not match rows of {x.shape[-1]}")
    _split_packed(weight_q, packed)


def _folded_norm_linears_impl(x, norm_weight, eps: float, offset: float, weight_q, weight_scale, bias, packed, backend: str):
    from quasar_hf.ops.cpu_fused_multi import folded_linears_prepacked

    if not is_bound_linear_input(x, weight_q[0].shape[1] if weight_q else -1, norm_weight.device) or backend != "cpu_fused":
        _folded_norm_linears_checked(x, norm_weight, weight_q, weight_scale, bias, packed, backend)
    entry = dispatch.backend_entry(backend)
    packs = [entry.unpack(w, p) for w, p in zip(weight_q, _split_packed(weight_q, packed))]
    norm_scale = (offset + norm_weight.float()).contiguous()  # what FoldedRMSNorm.prepare binds: offset + weight
    return list(folded_linears_prepacked(x, list(zip(weight_q, weight_scale, bias)), packs, norm_scale, eps))


def _folded_norm_linears_fake(x, norm_weight, eps: float, offset: float, weight_q, weight_scale, bias, packed, backend: str):
    _folded_norm_linears_checked(x, norm_weight, weight_q, weight_scale, bias, packed, backend)
    return [x.new_empty(*x.shape[:-1], w.shape[0]) for w in weight_q]


_LIB.impl("w8a8_folded_norm_linears", _folded_norm_linears_impl, "CompositeExplicitAutograd")
torch.library.register_fake("quasar::w8a8_folded_norm_linears", _folded_norm_linears_fake, lib=_LIB)
