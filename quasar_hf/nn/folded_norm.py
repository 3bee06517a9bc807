"""FoldedRMSNorm: an RMSNorm folded into the activation quantization of the W8A8 linears it feeds.

Per-token INT8 quantization does not see a row's overall scale, so W8A8(RMSNorm(x)) can quantize
x * w as it is and carry r(x) = 1 / sqrt(mean(x^2) + eps) in each row's dequantization scale: the
norm's output is never rounded before the GEMMs (oracle: `reference.w8a8_linear_rmsnorm_reference`).
On "cpu_fused" the norm, one quantization and every consumer's GEMM are one C call.

The contract is in the module tree. At load, the quantizer replaces each RMSNorm that the
architecture's SmoothQuant mapping says feeds a group of W8A8 linears (q/k/v, gate/up) with a
FoldedRMSNorm holding the same weight Parameter (state dicts are unchanged) and naming its
`consumers`. Its forward returns a `FoldedNormOutput`: a tensor whose values are the normalized
activations, so anything that reads it (an op inserted by another Transformers release, a LoRA
wrapper, a hook) reads RMSNorm(x). It also carries each consumer's output, computed by the fold.
A consumer called with that very tensor, unchanged since, returns its output from it; called with
anything else (a copy, `x * 1.0`, an edited tensor) it quantizes the values it is given.

Nothing is written on a module at forward time: two threads can run one model. The group is
bound once (`prepare`): at load, after `.to()` / `_apply`, `load_state_dict`, copies, and after an
in-place edit of a weight when the user calls `quasar_hf.prepare_weights(model)`. For float64
inputs, or where the consumers' backend has no folded form, the norm computes itself as its
Transformers class does and each consumer quantizes its output. Under torch.compile it traces to
the op `quasar::rms_norm` (nn/rowstable_norm.py) and each consumer to its own op; the post-grad
pass of compiled steps (ops/graph_passes.py) folds them back into one op on "cpu_fused".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from quasar_hf.nn.prepared_module import PreparedModule
from quasar_hf.nn.rowstable_norm import compiled_rms_norm, rms_norm_formula
from quasar_hf.ops.dispatch import bind_folded_group

FOLDABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the W8A8 kernels take


def rmsnorm_epsilon(norm: nn.Module) -> float | None:
    """The eps of a foldable RMSNorm module (a class of the architecture spec's, or a RowStableRMSNorm),
    or None when its class is not known to compute RMSNorm."""
    formula = rms_norm_formula(norm)
    return None if formula is None else formula[0]


class FoldedNormOutput(torch.Tensor):
    """RMSNorm(x) as values, carrying the output of each W8A8 consumer computed with the fold.

    Any op on it returns a plain tensor (torch function is disabled), so the outputs never travel
    beyond this tensor itself. `output_of(linear)` gives a consumer its output, or None when the
    tensor was edited in place since the norm wrote it (inference tensors keep no version counter:
    an in-place edit of one under torch.inference_mode is not seen).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl
    quasar_outputs: dict
    quasar_version: int | None

    @staticmethod
    def wrap(normed: torch.Tensor, consumers: Sequence[nn.Module], outputs: Sequence[torch.Tensor]) -> FoldedNormOutput:
        out = torch.Tensor._make_subclass(FoldedNormOutput, normed)
        out.quasar_outputs = dict(zip(consumers, outputs))
        out.quasar_version = None if normed.is_inference() else normed._version
        return out

    def output_of(self, linear: nn.Module) -> torch.Tensor | None:
        if self.quasar_version is not None and self._version != self.quasar_version:
            return None
        return self.quasar_outputs.get(linear)


class FoldedRMSNorm(PreparedModule):
    """An RMSNorm whose consumers are W8A8 linears: one folded call gives its output and theirs.

    weight: the replaced norm's Parameter (same object, same state-dict key); offset: 1.0 for
    Gemma's (1 + weight) norms, else 0.0; consumers: the W8A8Linears it feeds (left where the
    model holds them), consumer_names their paths in the decoder layer, for repr.
    """

    derived = ("_group",)

    def __init__(
        self, norm: nn.Module, consumers: Sequence[nn.Module], offset: float, eps: float, consumer_names: Sequence[str] = ()
    ) -> None:
        super().__init__()
        self.weight = norm.weight
        self.offset = float(offset)
        self.eps = float(eps)
        self.consumers = tuple(consumers)  # a tuple: not registered as children
        self.consumer_names = tuple(consumer_names)
        self.unfolded = (norm,)  # the replaced module: computes the norm where the fold cannot run
        self.formula = rms_norm_formula(norm)  # what a compiled step computes (quasar::rms_norm)
        self._group = None
        for linear in self.consumers:
            linear.fed_by = (self,)
        self.prepare()

    def prepare(self) -> None:
        """Bind the folded group over the consumers' prepared weights (None until every one is ready)."""
        ready = [getattr(c, "prepared", None) for c in self.consumers]
        group = None
        if self.weight.device.type != "meta" and ready and all(p is not None for p in ready):
            group = bind_folded_group(ready, self.offset + self.weight.detach().float(), self.eps)
        self._group = group

    @property
    def folded(self) -> bool:
        """True while the folded group is bound (else the norm computes itself, as its class does)."""
        return self._group is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., K]
        group = self._group
        if torch.compiler.is_compiling() and self.formula is not None:
            return compiled_rms_norm(x, self.weight, self.formula)  # one opaque op: rows reduced alone
        if group is None or x.dtype not in FOLDABLE_DTYPES or torch.compiler.is_compiling():
            return self.unfolded[0](x)
        normed, *outputs = group(x.detach())
        return FoldedNormOutput.wrap(normed, self.consumers, outputs)

    def extra_repr(self) -> str:
        names = ", ".join(self.consumer_names) or f"{len(self.consumers)} linears"
        folded = "yes" if self.folded else "no (computed as its class does)"
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}, consumers=[{names}], folded={folded}"
