"""FoldedRMSNorm: an RMSNorm whose output tells a W8A8 consumer how to fold the norm into its quantization.

Per-token INT8 quantization does not see a row's overall scale, so W8A8(RMSNorm(x)) can quantize
x * w as it is and carry r(x) = 1 / sqrt(mean(x^2) + eps) in each row's dequantization scale: the
norm's output is never rounded before the GEMM (oracle: `reference.w8a8_linear_rmsnorm_reference`).

The contract is the activation's type, nothing else. At load, the quantizer replaces each RMSNorm
that the architecture spec says feeds a group of W8A8 linears (q/k/v, gate/up) with a
FoldedRMSNorm holding the same weight Parameter (state dicts are unchanged). Its forward returns an
`RMSNormOutput`: a tensor whose values are RMSNorm(x), so anything that reads it (an op inserted by
another Transformers release, a LoRA wrapper, a hook) reads the normalized activations. It also
says what it normalizes (the norm's input x, the fp32 scale the norm multiplies by, eps) and, on
CPU, carries W8A8's quantization of itself with the norm folded in (int8 rows and per-row scales,
`quasar::rms_norm_quantize_rows`, one C call with the values). A W8A8Linear called with it takes
those rows as they are (on the fused CPU backend: its GEMM alone), or computes W8A8(RMSNorm(x))
from x with the norm folded in on its own backend; called with anything else (a copy, `x * 1.0`,
an edited tensor) it quantizes the values it is given. No module reads another module's state or
output except through its input tensor, and nothing is written on a module at forward time: two
threads can run one model.

Under torch.compile the norm traces to the op `quasar::rms_norm` and each consumer to its own
W8A8 op; the compiled step's grouping pass (ops/graph_passes.py) joins a norm and the linears that
read it into one call of `quasar::w8a8_folded_norm_linears_cpu_packed`, which gives each output the
bits an eager consumer computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from quasar_hf.nn.prepared_module import PreparedModule
from quasar_hf.nn.rowstable_norm import compiled_rms_norm, rms_norm_formula
from quasar_hf.ops import native

FOLDABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the W8A8 kernels take


def rmsnorm_epsilon(norm: nn.Module) -> float | None:
    """The eps of a foldable RMSNorm module (a class of the architecture spec's, or a RowStableRMSNorm),
    or None when its class is not known to compute RMSNorm."""
    formula = rms_norm_formula(norm)
    return None if formula is None else formula[0]


class RMSNormOutput(torch.Tensor):
    """RMSNorm(x) as values, with what was normalized and, on CPU, its W8A8 quantization.

    `fold()` gives (x, norm_scale fp32 [K], eps); `quantized_rows()` gives (int8 [M, K], fp32 scale
    [M]), the rows of x * norm_scale quantized with r(x) in their scales (reference.rmsnorm_quantize_reference),
    or None where the norm did not quantize. Any op on it returns a plain tensor (torch function is
    disabled), so neither travels beyond this tensor. Both are None once this tensor was edited in
    place since the norm ran, and `fold()` also once x was. Inference tensors keep no version
    counter: an x that is one is copied (so it cannot change under the fold), and an in-place edit of
    the output itself under torch.inference_mode is not seen.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl
    quasar_fold: tuple[torch.Tensor, torch.Tensor, float]
    quasar_rows: tuple[torch.Tensor, torch.Tensor] | None
    quasar_versions: tuple[int | None, int | None]

    @staticmethod
    def wrap(
        normed: torch.Tensor,
        x: torch.Tensor,
        norm_scale: torch.Tensor,
        eps: float,
        rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> RMSNormOutput:
        out = torch.Tensor._make_subclass(RMSNormOutput, normed)
        tracked = not x.is_inference()  # an inference tensor has no version counter: the fold keeps a copy
        out.quasar_fold = (x if tracked else x.clone(), norm_scale, eps)
        out.quasar_rows = rows
        out.quasar_versions = (None if normed.is_inference() else normed._version, x._version if tracked else None)
        return out

    def quantized_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        own = self.quasar_versions[0]
        return None if own is not None and self._version != own else self.quasar_rows

    def fold(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        own, source = self.quasar_versions
        if (own is not None and self._version != own) or (source is not None and self.quasar_fold[0]._version != source):
            return None
        x, norm_scale, eps = self.quasar_fold
        return x.detach(), norm_scale, eps


class FoldedRMSNorm(PreparedModule):
    """An RMSNorm whose consumers are W8A8 linears: its output lets each fold the norm into its own call.

    weight: the replaced norm's Parameter (same object, same state-dict key); offset: 1.0 for
    Gemma's (1 + weight) norms, else 0.0; consumer_names: the paths in the decoder layer of the
    linears that read it (for repr only: the norm holds no reference to them).
    """

    derived = ("_norm_scale", "_quantizes")

    def __init__(self, norm: nn.Module, offset: float, eps: float, consumer_names: Sequence[str] = ()) -> None:
        super().__init__()
        if not (math.isfinite(eps) and eps >= 0.0):
            raise ValueError(f"norm eps must be a finite number >= 0, got {eps!r}; check the norm's eps in the model config")
        self.weight = norm.weight
        self.offset = float(offset)
        self.eps = float(eps)
        self.consumer_names = tuple(consumer_names)
        self.unfolded = (norm,)  # the replaced module: computes the norm where the fold cannot run
        self.formula = rms_norm_formula(norm)  # what `quasar::rms_norm` computes
        if self.formula is None:
            raise TypeError(f"{type(norm).__name__} is not an RMSNorm class quasar_hf knows: it cannot be folded")
        self._norm_scale: torch.Tensor | None = None
        self._quantizes = False
        self.prepare()

    def prepare(self) -> None:
        """The fp32 scale the fold multiplies x by, offset + weight (None while the weight is on meta),
        and whether this norm quantizes its output (on CPU, where the C++ op serves it)."""
        weight = self.weight.detach()
        self._norm_scale = None if weight.device.type == "meta" else (self.offset + weight.float()).contiguous()
        self._quantizes = (
            self._norm_scale is not None and weight.is_cpu and native.op_unavailable_reason("rms_norm_quantize_rows") is None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., K]
        if torch.compiler.is_compiling():
            return compiled_rms_norm(x, self.weight, self.formula)  # one opaque op: rows reduced alone
        scale = self._norm_scale
        if self._quantizes and x.is_cpu and x.dtype in FOLDABLE_DTYPES:  # values and int8 rows: one C call
            normed, q, row_scale = torch.ops.quasar.rms_norm_quantize_rows.default(x, scale, self.eps)
            return RMSNormOutput.wrap(normed, x, scale, self.eps, (q, row_scale))
        if scale is None or x.dtype not in FOLDABLE_DTYPES or x.device != scale.device:
            return self.unfolded[0](x)
        normed = torch.ops.quasar.rms_norm.default(x, self.weight, *self.formula)  # what compiled steps compute
        return RMSNormOutput.wrap(normed, x, scale, self.eps)

    def extra_repr(self) -> str:
        names = ", ".join(self.consumer_names) or "W8A8 linears"
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}, folded into=[{names}]"
