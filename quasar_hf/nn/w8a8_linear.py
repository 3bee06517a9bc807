"""W8A8Linear: an nn.Linear replacement holding INT8 weights, quantizing activations per token."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from quasar_hf.nn.norm_fold import marked_fold
from quasar_hf.ops.reference import quantize_weight_per_channel

if TYPE_CHECKING:
    from quasar_hf.nn.shared_input import SharedInput

_KERNEL_BUFFERS = ("weight", "weight_scale", "bias", "act_prescale")


class W8A8Linear(nn.Module):
    """y = dequant(int8(x * act_prescale) @ int8(W).T) + bias, with exact int32 accumulation.

    Serialized state (stable names):
      weight        int8    [out_features, in_features]  symmetric, per output channel
      weight_scale  float32 [out_features]               max|W[n, :]| / 127
      bias          model dtype [out_features]           optional
      act_prescale  float32 [in_features]                optional SmoothQuant 1/s that could
                                                         not be folded into a preceding op
    The kernel is chosen by `backend` through `quasar_hf.ops.dispatch` (one dispatch point).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        has_act_prescale: bool = False,
        backend: str = "auto",
        bias_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype or torch.float32, device=device))
        else:
            self.bias = None
        if has_act_prescale:
            self.register_buffer("act_prescale", torch.ones(in_features, dtype=torch.float32, device=device))
        else:
            self.act_prescale = None
        # The kernel bound to these buffers (validated and packed once), rebuilt when any changes:
        # kernel_key is the buffers' identity, storage and versions it was bound for, packed_weight the
        # backend's layout of `weight` (also read by `shared_input`'s shared call, never copied).
        self._bound: object | None = None
        self.kernel_key: tuple | None = None
        self.packed_weight: object | None = None
        # Siblings reading the same input (q/k/v, gate/up) quantize it once: nn/shared_input.py.
        self.shared_input: SharedInput | None = None
        self.shared_index = 0  # this module's place among shared_input.members

    @classmethod
    def from_linear(cls, linear: nn.Linear, act_prescale: torch.Tensor | None = None, backend: str = "auto") -> W8A8Linear:
        """Quantize a float nn.Linear. `act_prescale` [in] is applied to x at run time, not to W."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"W8A8Linear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        return cls.from_weight(linear.weight, linear.bias, act_prescale, backend)

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        act_prescale: torch.Tensor | None = None,
        backend: str = "auto",
        rounded: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> W8A8Linear:
        """Quantize a float weight [out, in] (any float dtype; fp32 keeps smoothing exact); bias keeps its dtype.

        `rounded` = (int8 [out, in], fp32 scale [out]) computed elsewhere (GPTQ) replaces nearest rounding.
        """
        out_features, in_features = weight.shape
        module = cls(
            in_features,
            out_features,
            bias=bias is not None,
            has_act_prescale=act_prescale is not None,
            backend=backend,
            bias_dtype=bias.dtype if bias is not None else None,
            device=weight.device,
        )
        q, scale = quantize_weight_per_channel(weight) if rounded is None else rounded
        if q.shape != weight.shape or q.dtype != torch.int8 or scale.shape != (out_features,):
            raise ValueError(
                f"rounded weights must be int8 {tuple(weight.shape)} and scales ({out_features},); "
                f"got {q.dtype} {tuple(q.shape)} and {tuple(scale.shape)}"
            )
        module.weight.copy_(q)
        module.weight_scale.copy_(scale)
        if bias is not None:
            module.bias.copy_(bias.detach())
        if act_prescale is not None:
            if act_prescale.shape != (in_features,):
                raise ValueError(f"act_prescale must have shape ({in_features},), got {tuple(act_prescale.shape)}")
            module.act_prescale.copy_(act_prescale.detach().float())
        return module

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight this module computes with: W[n, k] = q[n, k] * scale[n] (prescale excluded)."""
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def _buffers_key(self) -> tuple:
        """Identity, storage and in-place version of every buffer the kernel reads, and the backend.
        Read from `_buffers` directly: this runs on every call, and Module.__getattr__ is slow."""
        buffers, key = self._buffers, [self.backend]
        for name in _KERNEL_BUFFERS:
            t = buffers.get(name)
            if t is None and name in self.__dict__:  # a plain attribute (bias=False: None)
                t = self.__dict__[name]
            key += (None, None, None) if t is None else (id(t), t.data_ptr(), None if t.is_inference() else t._version)
        return tuple(key)

    def kernel(self):
        """`linear(x)` bound to the current buffers; rebound on the first call, after .to(),
        load_state_dict, in-place edits or a backend change."""
        key = self._buffers_key()
        if key != self.kernel_key:
            from quasar_hf.ops.dispatch import bind_w8a8_linear, pack_weight_for
            from quasar_hf.ops.validation import validate_weights

            self._bound = self.packed_weight = None  # release the old packed weight first
            validate_weights(self.weight, self.weight_scale, self.bias, self.act_prescale)
            self.packed_weight = pack_weight_for(self.weight, self.backend)
            self._bound = bind_w8a8_linear(
                self.weight, self.weight_scale, self.bias, self.act_prescale, self.backend, packed=self.packed_weight
            )
            self.kernel_key = key
        return self._bound

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if torch.compiler.is_compiling():  # traced: one `quasar::w8a8_linear` op (ops/torch_ops.py)
            return torch.ops.quasar.w8a8_linear(x, self.weight, self.weight_scale, self.bias, self.act_prescale, self.backend)
        if self.shared_input is not None:
            y = self.shared_input.output(self.shared_index, x)
            if y is not None:
                return y
        fold = marked_fold(x)
        if fold is not None:  # a folded norm's pass-through reaching a linear on its own: normalize it
            x = fold.normalize(x)
        return self.kernel()(x)

    def __getstate__(self) -> dict:  # copies and pickles rebind: kernels are closures over raw pointers
        state = super().__getstate__()
        state.update(_bound=None, kernel_key=None, packed_weight=None)
        return state

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, act_prescale={self.act_prescale is not None}, "
            f"weight=int8 per-channel, activations=int8 per-token, backend={self.backend!r}"
        )
