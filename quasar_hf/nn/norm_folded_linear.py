"""NormFoldedW8A8Linear: an RMSNorm and the W8A8 projections it feeds (q/k/v, gate/up) as one linear;
FusedProjectionSlice: where each projection was, its columns of that linear's output.

Per-token INT8 quantization does not see a row's overall scale, so W8A8(RMSNorm(x)) can quantize
x * (offset + w) as it is and carry r(x) = 1 / sqrt(mean(x^2) + eps) in each row's scale: the norm's
output is never rounded (oracle: `reference.w8a8_linear_rmsnorm_reference`). And the projections
that read one norm read the same rows, so their int8 weights are stacked into one [sum N, K] weight:
one activation quantization and one GEMM launch per group, on every backend, eager and compiled
alike (each module calls one `quasar::` op; no graph pass is involved).

Data flows through tensors only. At load (hf/fusion.py), the norm's place in the decoder layer takes
a NormFoldedW8A8Linear holding the norm's weight Parameter and the stacked W8A8Linear: the layer
calls it where it called the norm, and it returns the projections [..., sum N]. Each projection's
place takes a FusedProjectionSlice that returns its columns of the tensor it is given, and refuses a
tensor of any other width. The decoder layer's forward (Transformers' own) is unchanged. Saved names
are unchanged too: hf/fusion.py's state-dict hooks on the layer split the stacked tensors into each
projection's `weight` / `weight_scale` / `bias` when saving and stack them when loading.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from quasar_hf.nn.prepared_module import PreparedModule
from quasar_hf.nn.rowstable_norm import compiled_rms_norm, rms_norm_formula
from quasar_hf.nn.w8a8_linear import W8A8Linear


def rmsnorm_epsilon(norm: nn.Module) -> float | None:
    """The eps of a foldable RMSNorm module (a class of the architecture spec's, or a RowStableRMSNorm),
    or None when its class is not known to compute RMSNorm."""
    formula = rms_norm_formula(norm)
    return None if formula is None else formula[0]


class NormFoldedW8A8Linear(PreparedModule):
    """y = W8A8(RMSNorm(x)) [..., K] -> [..., sum N] for the stacked weights of the projections a norm feeds.

    weight: the replaced norm's Parameter (same object, same state-dict key); linear: the stacked
    W8A8Linear (its tensors are saved under the projections' own names); members: (path in the
    decoder layer, first column, last column + 1) of each projection; unfolded: the replaced norm
    (what `hf.fusion.unfuse_projections` puts back). Where the linear cannot fold (a backend with no
    folded form), the norm runs first as `quasar::rms_norm` and the linear quantizes its output.
    """

    def __init__(self, norm: nn.Module, linear: W8A8Linear, members: Sequence[tuple[str, int, int]]) -> None:
        super().__init__()
        formula = rms_norm_formula(norm)
        if formula is None:
            raise TypeError(f"{type(norm).__name__} is not an RMSNorm class quasar_hf knows: it cannot be folded")
        eps, offset, _ = formula
        if not (math.isfinite(eps) and eps >= 0.0):
            raise ValueError(f"norm eps must be a finite number >= 0, got {eps!r}; check the norm's eps in the model config")
        if linear.in_features != norm.weight.shape[-1] or (members and members[-1][2] != linear.out_features):
            raise ValueError("the stacked linear must read the norm's rows and its columns must be the members'")
        self.weight = norm.weight
        self.linear = linear
        self.members = tuple((str(path), int(start), int(stop)) for path, start, stop in members)
        self.formula = formula  # (eps, offset, scale_in_float): what `quasar::rms_norm` computes
        self.eps, self.offset = float(eps), float(offset)
        self.unfolded = (norm,)  # a tuple: not a child module, not in the state dict
        self._norm_scale: torch.Tensor | None = None
        self.prepare()

    def prepare(self) -> None:
        """The fp32 scale the fold multiplies x by, offset + weight (None while the weight is on meta)."""
        weight = self.weight.detach()
        self._norm_scale = None if weight.device.type == "meta" else (self.offset + weight.float()).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., sum N]
        scale = self._norm_scale
        y = None if scale is None else self.linear.of_rms_norm(x, scale, self.eps)  # one op: norm, quantization, GEMM
        return self.linear(compiled_rms_norm(x, self.weight, self.formula)) if y is None else y

    def register_forward_hook(self, hook, *args, **kwargs):
        """As nn.Module's, with a warning: the output this hook sees is the stacked projections."""
        warnings.warn(
            f"a forward hook on this fused norm receives its projections [..., {self.linear.out_features}] "
            f"({', '.join(path for path, _, _ in self.members)}), not the normed hidden states "
            f"[..., {self.linear.in_features}]. To hook the norm's own output, register the hook inside "
            "`with quasar_hf.hf.fusion.projections_apart(model):`.",
            UserWarning,
            stacklevel=2,
        )
        return super().register_forward_hook(hook, *args, **kwargs)

    def extra_repr(self) -> str:
        columns = ", ".join(f"{path}[{start}:{stop}]" for path, start, stop in self.members)
        return (
            f"RMSNorm {tuple(self.weight.shape)} eps={self.eps} offset={self.offset} folded into one W8A8 linear of [{columns}]"
        )


class FusedProjectionSlice(nn.Module):
    """A projection fused into its norm's NormFoldedW8A8Linear: columns [start, stop) of that module's
    output [..., total] (a view). `source` names that module's path in the decoder layer (for errors
    and repr); `in_features` is the width the projection reads (the norm's). It holds no tensor: reading
    `weight`, `bias`, `weight_scale` or `act_prescale` raises an AttributeError that names
    `projections_apart`, which gives each projection its own W8A8Linear again."""

    TENSORS = ("weight", "bias", "weight_scale", "act_prescale")  # what a linear has and this slice does not hold

    def __init__(self, start: int, stop: int, total: int, source: str, in_features: int | None = None) -> None:
        super().__init__()
        if not 0 <= start < stop <= total:
            raise ValueError(f"columns [{start}, {stop}) are not inside an output of {total}")
        self.start, self.stop, self.total, self.source = int(start), int(stop), int(total), source
        self.in_features = in_features

    @property
    def out_features(self) -> int:
        return self.stop - self.start

    def __getattr__(self, name: str):
        if name in FusedProjectionSlice.TENSORS:
            raise AttributeError(
                f"this projection has no {name} of its own: quasar_hf fused it with its norm into {self.source!r} "
                "(one stacked W8A8 linear). For code that reads or wraps single projections (peft, hooks), run it "
                "inside `with quasar_hf.hf.fusion.projections_apart(model):`, or call unfuse_projections(model) first."
            )
        return super().__getattr__(name)

    def forward(self, fused: torch.Tensor) -> torch.Tensor:  # [..., total] -> [..., stop - start]
        if fused.shape[-1] != self.total:
            raise ValueError(
                f"this projection was fused into {self.source!r} (quasar_hf NormFoldedW8A8Linear) and takes that "
                f"module's output of width {self.total}, got width {fused.shape[-1]}. Call the decoder layer, or "
                "run quasar_hf.hf.fusion.unfuse_projections(model) to call projections on their own"
            )
        return fused[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"columns [{self.start}:{self.stop}] of {self.source}'s fused output; single projections: projections_apart(model)"
