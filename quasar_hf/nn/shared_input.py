"""Sibling W8A8Linears that read one input tensor (q/k/v; gate/up) quantize it once per forward.

`share_input(modules)` binds one `SharedInput` to the modules (per instance: no global state).
The first member called with a tensor x computes every member's output in one shared call
(`ops/multi.py`: one quantization, and on "cpu_fused" one C call) and keeps the other outputs
for exactly that x: the same tensor object (weak reference), in-place version, data pointer,
shape and strides. Each other member called with that x takes its output once. Anything else
runs the member alone, with the same bits: another tensor, an inference tensor (it keeps no
version counter), members whose act_prescale differ, a backend without a shared form. If the
members keep leaving outputs unclaimed (they are not called on one tensor), sharing stops.

A group may also carry the RMSNorm that feeds it (`norm`, nn/norm_fold.py): an input marked as
that norm's pass-through is normalized inside the shared call; a member running alone on it
normalizes it first (W8A8Linear.forward).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from quasar_hf.nn.norm_fold import NormFold

MAX_UNCLAIMED = 4  # shared calls in a row that left outputs unclaimed before sharing stops


class SharedInput:
    """The shared-call state of one group of sibling W8A8Linears (held by each member)."""

    def __init__(self, members: Sequence[torch.nn.Module]) -> None:
        self.members = tuple(members)
        self.norm: NormFold | None = None  # the RMSNorm folded into this group's quantization, if any
        self._reset()

    def _reset(self) -> None:
        self._linear = None  # ops.multi bound function, or None when the members cannot share
        self._key: tuple | None = None  # the members' buffer keys `_linear` was bound for
        self._linear_folded = None  # the same with `norm` folded in, or None where it cannot be
        self._folded_key: tuple | None = None  # (norm weight key, eps) `_linear_folded` was bound for
        self._fold_ok: bool | None = None  # can_fold's answer for the current binding
        self._pending: list | None = None  # outputs not yet claimed, None where claimed
        self._x_ref: weakref.ref | None = None
        self._x_key: tuple | None = None
        self._unclaimed = 0
        self.stopped = False

    def __getstate__(self) -> dict:  # copies and pickles keep the members, not bound kernels or outputs
        return {"members": self.members, "norm": self.norm}

    def __setstate__(self, state: dict) -> None:
        self.members = state["members"]
        self.norm = state.get("norm")
        self._reset()

    def can_fold(self) -> bool:
        """True while the shared call can normalize `norm`'s pass-through itself (bound once, then cached)."""
        if self.norm is None or self.stopped:
            return False
        if self._fold_ok is None:
            self._fold_ok = self._bound(folded=True) is not None
        return self._fold_ok

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member `index`'s output for x from a shared call, or None: run the member alone."""
        if not isinstance(x, torch.Tensor) or x.is_inference() or self.stopped:
            return None
        key = (x._version, x.data_ptr(), x.shape, x.stride())
        pending = self._pending
        if pending is not None and pending[index] is not None and self._x_ref() is x and self._x_key == key:
            y, pending[index] = pending[index], None
            if not any(o is not None for o in pending):  # all claimed: hold nothing between forwards
                self._pending = self._x_ref = None
                self._unclaimed = 0
            return y
        linear = self._bound(folded=self.norm is not None and self.norm.owns(x))
        if linear is None:
            return None
        if pending is not None:  # a shared call whose outputs were not all claimed
            self._unclaimed += 1
            self._pending = self._x_ref = None
            if self._unclaimed >= MAX_UNCLAIMED:
                self.stopped = True
                return None
        outputs = list(linear(x))
        y, outputs[index] = outputs[index], None
        self._pending, self._x_ref, self._x_key = outputs, weakref.ref(x), key
        return y

    def _bound(self, folded: bool = False):
        """The shared kernel for the members' current buffers (rebound when any member rebinds);
        folded=True: the one that also applies `norm` (None where the backend cannot)."""
        for m in self.members:
            m.kernel()  # each member's own binding (and packed weight) is current
        key = tuple(m.kernel_key for m in self.members)
        if key != self._key:
            self._linear = self._linear_folded = None  # release the old kernels before binding new ones
            self._linear = self._bind()
            self._key, self._folded_key, self._fold_ok = key, None, None
        if not folded:
            return self._linear
        scale = self.norm.scale()
        folded_key = (self.norm.scale_key, self.norm.eps)  # the norm weight's identity and version
        if folded_key != self._folded_key:
            self._linear_folded = None
            self._linear_folded = self._bind(scale) if self._linear is not None else None
            self._folded_key = folded_key
        return self._linear_folded

    def _bind(self, norm_scale: torch.Tensor | None = None):
        """ops.multi's shared linear over the members, or None when they cannot share an input.
        With norm_scale [K] (fp32): the linear over `norm`'s input, the norm folded in."""
        from quasar_hf.ops.multi import bind_w8a8_siblings

        first = self.members[0]
        prescales = [m.act_prescale for m in self.members]
        same_prescale = all(p is None for p in prescales) or all(
            p is not None and p.shape == prescales[0].shape and torch.equal(p, prescales[0]) for p in prescales
        )
        similar = all(
            m.backend == first.backend and m.in_features == first.in_features and m.weight.device == first.weight.device
            for m in self.members
        )
        if not (same_prescale and similar):
            return None
        weights = [(m.weight, m.weight_scale, m.bias) for m in self.members]
        packed = [m.packed_weight for m in self.members]
        if norm_scale is None:
            return bind_w8a8_siblings(weights, first.act_prescale, first.backend, packed)
        if norm_scale.device != first.weight.device:
            return None
        prescale = norm_scale if first.act_prescale is None else norm_scale * first.act_prescale.float()
        return bind_w8a8_siblings(weights, prescale, first.backend, packed, norm_eps=self.norm.eps)


def share_input(modules: Sequence[torch.nn.Module]) -> SharedInput | None:
    """Bind one SharedInput to sibling W8A8Linears that read the same tensor; None if fewer than two."""
    from quasar_hf.nn.w8a8_linear import W8A8Linear

    if len(modules) < 2 or not all(isinstance(m, W8A8Linear) for m in modules):
        return None
    group = SharedInput(modules)
    for index, module in enumerate(modules):
        module.shared_input, module.shared_index = group, index
    return group


def unshare_input(module: torch.nn.Module) -> None:
    """Detach `module` (and its siblings) from their SharedInput: each runs alone again (and the
    norm folded into the group, if any, computes itself again)."""
    group = getattr(module, "shared_input", None)
    if group is not None and group.norm is not None:
        from quasar_hf.nn.norm_fold import unfold_norm

        unfold_norm(group.norm.norm)
    for member in group.members if group is not None else ():
        member.shared_input = None
