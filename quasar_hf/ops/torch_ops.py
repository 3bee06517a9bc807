"""The kernels as PyTorch operators (`torch.ops.quasar.*`) with fake implementations, so
`torch.compile` traces a Quasar model: each kernel is one opaque node whose output shape the
fake implementation gives, and Inductor calls the real kernel at run time.

  quasar::w8a8_linear(x, weight_q, weight_scale, bias?, act_prescale?, backend) -> [..., N]
  quasar::rowstable_attention_cpu(query, key, value, visible?, scale?) -> [B, Q, H, D]
  quasar::rowstable_attention_triton(query, key, value, visible?, scale?) -> [B, Q, H, D]

Registered with `torch.library.Library` (define + impl + `register_fake`) rather than the
`torch.library.custom_op` decorator: both give the same operator, but the decorator's Python
wrapper (autograd and aliasing checks) costs ~20 us per call against ~4 us here, and a compiled
SmolLM2 verify step calls the linear op 210 times. Eager code never goes through these ops: the
public functions call the kernels directly and switch to the op only while `torch.compile`
traces (`torch.compiler.is_compiling()`), so eager per-call cost is unchanged.

The linear op prepares each weight (validation, backend choice, packed layout) once and keeps
that next to a weak reference to `weight_q`, so a compiled graph does not repack the weight on
every call; an in-place edit of any weight tensor (its version counter) or a new tensor
prepares again, and the entry goes away with the weight. Inference only: no autograd formulas.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from quasar_hf.ops import dispatch
from quasar_hf.ops.validation import tensor_version, validate_w8a8_inputs, x_matches

_LIB = torch.library.Library("quasar", "DEF")
_LIB.define(
    "w8a8_linear(Tensor x, Tensor weight_q, Tensor weight_scale, Tensor? bias, Tensor? act_prescale, str backend) -> Tensor"
)
_LIB.define("rowstable_attention_cpu(Tensor query, Tensor key, Tensor value, Tensor? visible, float? scale) -> Tensor")
_LIB.define("rowstable_attention_triton(Tensor query, Tensor key, Tensor value, Tensor? visible, float? scale) -> Tensor")


# ---- quasar::w8a8_linear -------------------------------------------------------------------


def _version_key(*tensors: torch.Tensor | None) -> tuple:
    return tuple((None, None) if t is None else (id(t), tensor_version(t)) for t in tensors)


class _Prepared:
    """One weight's validated backend and packed layout; holds no reference to weight_q itself."""

    def __init__(self, weight_q, weight_scale, bias, act_prescale, backend: str) -> None:
        dispatch.validate_weights(weight_q, weight_scale, bias, act_prescale)
        entry = dispatch._TABLE[dispatch.resolve_backend(backend, weight_q.device)]
        self.packed = entry.pack(weight_q) if entry.pack is not None else None
        self.run: Callable[..., torch.Tensor] = entry.run_prepacked if self.packed is not None else entry.run
        # The other tensors are held (small vectors), so their ids in the key stay theirs.
        self.key = (tensor_version(weight_q), backend, *_version_key(weight_scale, bias, act_prescale))
        self.others = (weight_scale, bias, act_prescale)


_PREPARED: dict[int, tuple[weakref.ref, _Prepared]] = {}


def _prepared_for(weight_q, weight_scale, bias, act_prescale, backend: str) -> _Prepared:
    """The cached preparation of these weights, rebuilt when any of them changed."""
    slot = _PREPARED.get(id(weight_q))
    key = (tensor_version(weight_q), backend, *_version_key(weight_scale, bias, act_prescale))
    if slot is not None and slot[0]() is weight_q and slot[1].key == key:
        return slot[1]
    prepared = _Prepared(weight_q, weight_scale, bias, act_prescale, backend)
    ident = id(weight_q)
    _PREPARED[ident] = (weakref.ref(weight_q, lambda _ref: _PREPARED.pop(ident, None)), prepared)
    return prepared


def _w8a8_linear_impl(x, weight_q, weight_scale, bias, act_prescale, backend: str) -> torch.Tensor:
    prepared = _prepared_for(weight_q, weight_scale, bias, act_prescale, backend)
    if not x_matches(x, weight_q.shape[1], weight_q.device):
        validate_w8a8_inputs(x, weight_q, weight_scale, bias, act_prescale)  # raises the precise error
    if x.numel() == 0:
        return x.new_zeros(*x.shape[:-1], weight_q.shape[0])
    return prepared.run(x, weight_q, weight_scale, bias, act_prescale, prepared.packed)


def _w8a8_linear_fake(x, weight_q, weight_scale, bias, act_prescale, backend: str) -> torch.Tensor:
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
