"""An RMSNorm folded into the activation quantization of the W8A8 siblings it alone feeds.

Per-token INT8 quantization does not see a row's overall scale, so RMSNorm(x) = r(x) * x * w
(r = 1 / sqrt(mean(x^2) + eps), one number per row) quantizes to the same integers as x * w,
with r moved into the row's dequantization scale. The fused CPU kernel does exactly that
(`qhf_w8a8_linear_multi` with norm_eps; oracle `reference.w8a8_linear_rmsnorm_reference`): the
norm costs no separate pass, no rounding of its output and no Python call of its own.

Binding is per instance. `fold_norm(norm, group, ...)` sets the norm module's `forward` to a
pass-through that returns a view of its input, marked as "this norm's input, not yet normalized"
(the mark names the fold and the view's version), and the decoder layer's `forward` to one that
arms its folds while it runs. The group's shared call (`nn/shared_input.py`) normalizes a marked
input inside the kernel; a W8A8Linear running alone on a marked input normalizes it first with
the norm's own forward. Anything unmarked is taken as it is, so `q_proj(h)` means what it says.

The norm passes its input through only while its decoder layer's forward runs, where the
architecture's mapping says the siblings alone read the norm's output (the condition under which
SmoothQuant moves factors into the norm's weight: `smoothquant/mappings.py` declares both), and
only while no hook watches the norm, the siblings or the module holding them. Called any other
way (directly, under torch.compile, with autograd on, on inference-mode, non-CPU or float64
tensors, or where the siblings' backend has no fused form) it computes the norm as its class
does. Row r's result depends on row r only, so verify-step rows equal decode-step rows bit for
bit, as before. The "cpu_fused" backend folds in its C kernel and "reference" in its oracle (the
same bits); other backends, and norms that Accelerate dispatches, are not folded: their results
differ from the folded ones by rounding only.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch
from torch import nn

from quasar_hf import compat

if TYPE_CHECKING:
    from quasar_hf.nn.shared_input import SharedInput

# RMSNorm classes computing x * rsqrt(mean(x^2) + eps) * (offset + weight), and their eps attribute
# (the offset comes from the SmoothQuant mapping: 1 for Gemma's (1 + w) norms).
FOLDABLE_RMSNORMS = {
    "LlamaRMSNorm": "variance_epsilon",
    "MistralRMSNorm": "variance_epsilon",
    "Qwen2RMSNorm": "variance_epsilon",
    "Qwen3RMSNorm": "variance_epsilon",
    "Gemma3RMSNorm": "eps",
}
_MARK = "_quasar_unnormalized"  # attribute on a pass-through tensor: (fold, its version when marked)
_FOLDABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class LayerArming:
    """How deep the decoder layer's own forward is running (its folds pass inputs through only then)."""

    def __init__(self) -> None:
        self.depth = 0

    def __getstate__(self) -> dict:  # a copy starts outside any forward
        return {}

    def __setstate__(self, state: dict) -> None:
        self.depth = 0


class NormFold:
    """The fold of one RMSNorm module into one SharedInput group (held by both)."""

    def __init__(
        self,
        norm: nn.Module,
        group: SharedInput,
        offset: float,
        eps: float,
        arming: LayerArming,
        watched: tuple[nn.Module, ...],
    ) -> None:
        self.norm = norm
        self.group = group
        self.offset = float(offset)
        self.eps = float(eps)
        self.arming = arming
        self.watched = watched  # the norm, the siblings and the modules holding them: hooks turn the fold off
        self._scale: torch.Tensor | None = None
        self.scale_key: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The norm's forward while folded: a marked view of x where the siblings can fold it."""
        if not self._can_pass(x):
            return self.normalize(x)
        y = x.view_as(x)
        setattr(y, _MARK, (self, y._version))
        return y

    def _can_pass(self, x: object) -> bool:
        return (
            self.arming.depth > 0
            and isinstance(x, torch.Tensor)
            and x.is_cpu
            and x.dtype in _FOLDABLE_DTYPES
            and not x.requires_grad
            and not x.is_inference()
            and not torch.compiler.is_compiling()
            and not any(compat.has_forward_hooks(m) for m in self.watched)
            and self.group.can_fold()
        )

    def owns(self, x: torch.Tensor) -> bool:
        """True if x is this norm's pass-through output, unchanged since: normalize it before use."""
        return marked_fold(x) is self

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The norm as its class computes it (Transformers' forward, unfolded)."""
        return type(self.norm).forward(self.norm, x)

    def scale(self) -> torch.Tensor:
        """fp32 [K]: offset + weight, what the normalized row is multiplied by (kept while the weight is)."""
        weight = self.norm.weight
        key = (id(weight), weight.data_ptr(), weight._version, weight.device)
        if key != self.scale_key:
            self._scale = (self.offset + weight.detach().float()).contiguous()
            self.scale_key = key
        return self._scale

    def __getstate__(self) -> dict:  # copies keep the binding, not the cached scale
        state = dict(self.__dict__)
        state.update(_scale=None, scale_key=None)
        return state


def rmsnorm_epsilon(norm: nn.Module) -> float | None:
    """The eps of a foldable RMSNorm module, or None when its class is not known to compute RMSNorm."""
    attribute = FOLDABLE_RMSNORMS.get(type(norm).__name__)
    eps = getattr(norm, attribute, None) if attribute else None
    weight = getattr(norm, "weight", None)
    if not isinstance(eps, (int, float)) or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    return float(eps)


def fold_norm(
    layer: nn.Module, norm: nn.Module, group: SharedInput, offset: float, eps: float, holders: tuple[nn.Module, ...] = ()
) -> NormFold:
    """Fold `norm` (inside decoder `layer`) into `group`'s activation quantization, per instance:
    the classes are untouched. `holders`: the modules between the layer and the siblings."""
    arming = layer.__dict__.get("quasar_fold_arming")
    if arming is None:
        arming = LayerArming()
        layer.quasar_fold_arming = arming
        layer.forward = types.MethodType(_armed_layer_forward, layer)
    fold = NormFold(norm, group, offset, eps, arming, (norm, *group.members, *holders))
    group.norm = fold
    norm.forward = types.MethodType(_folded_forward, norm)
    norm.quasar_norm_fold = fold
    return fold


def unfold_norm(norm: nn.Module) -> None:
    """Undo fold_norm for one norm: it computes itself again and its group takes inputs as they are."""
    fold = norm.__dict__.pop("quasar_norm_fold", None)
    norm.__dict__.pop("forward", None)
    if fold is not None:
        fold.group.norm = None


def _folded_forward(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm.quasar_norm_fold.forward(x)


def _armed_layer_forward(layer: nn.Module, *args, **kwargs):
    arming = layer.quasar_fold_arming
    arming.depth += 1
    try:
        return type(layer).forward(layer, *args, **kwargs)
    finally:
        arming.depth -= 1


def marked_fold(x: object) -> NormFold | None:
    """The fold whose pass-through x is (unchanged since), or None: x is what it looks like."""
    mark = x.__dict__.get(_MARK) if isinstance(x, torch.Tensor) else None
    return mark[0] if mark is not None and mark[1] == x._version else None
