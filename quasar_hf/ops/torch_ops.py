"""Every kernel as a PyTorch operator (`torch.ops.quasar.*`): the C kernels' operators of
ops/kernel_ops.py, and here the generic `quasar::w8a8_linear`, which runs the W8A8 backend it names
(ops/dispatch.py). Eager modules and compiled graphs call these operators alike; on CPU the
dispatcher runs the C++ implementations ops/native.py registers.

  quasar::w8a8_linear(x, weight_q, weight_scale, bias?, act_prescale?, packed[], backend) -> [..., N]
      (every backend but "cpu_fused": the one it names runs, on packed tensors made once when prepared)
  quasar::w8a8_folded_norm_linear(x, norm_scale, eps, weight_q, weight_scale, bias?, packed[], backend)
      -> [..., N]   (W8A8(RMSNorm(x)), the norm folded into the quantization: a NormFoldedW8A8Linear
      on every backend that folds but "cpu_fused", whose op is in ops/kernel_ops.py)

`OPS` is the table of every operator (doctor, opcheck and the docs' op table read it).
"""

from __future__ import annotations

import torch

from quasar_hf.ops import dispatch
from quasar_hf.ops.kernel_ops import KERNEL_OPS, Args, OpSpec, register, sample_rows
from quasar_hf.ops.validation import is_bound_linear_input, validate_w8a8_inputs

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


def _sample_linear(gen: torch.Generator) -> Args:
    w_q = torch.randint(-127, 128, (17, 40), generator=gen, dtype=torch.int8)
    return sample_rows(gen), w_q, torch.rand(17, generator=gen) / 100, None, None, [], "reference"


GENERIC_W8A8 = OpSpec(
        "w8a8_linear(Tensor x, Tensor weight_q, Tensor weight_scale, Tensor? bias, Tensor? act_prescale, "
        "Tensor[] packed, str backend) -> Tensor",
        _w8a8_linear_fake, _w8a8_linear_impl, "reference.w8a8_linear_reference", _sample_linear,
)  # fmt: skip


# ---- quasar::w8a8_folded_norm_linear -------------------------------------------------------


def _check_folded(x, norm_scale, eps: float, weight_q, weight_scale, bias) -> None:
    validate_w8a8_inputs(x, weight_q, weight_scale, bias, None)  # the linear's own errors first
    k = weight_q.shape[1]
    if norm_scale.dtype != torch.float32 or tuple(norm_scale.shape) != (k,) or norm_scale.device != weight_q.device:
        raise ValueError(f"w8a8_folded_norm_linear: norm_scale must be fp32 [{k}] on {weight_q.device}, got "
                         f"{norm_scale.dtype} {tuple(norm_scale.shape)} on {norm_scale.device}")  # fmt: skip
    if not (eps >= 0.0 and eps < float("inf")):
        raise ValueError(f"w8a8_folded_norm_linear: eps must be a finite number >= 0, got {eps!r}")


def _folded_impl(x, norm_scale, eps: float, weight_q, weight_scale, bias, packed: list, backend: str) -> torch.Tensor:
    if not is_bound_linear_input(x, weight_q.shape[1], weight_q.device):
        _check_folded(x, norm_scale, eps, weight_q, weight_scale, bias)  # raises the precise error
    if x.numel() == 0:
        return x.new_zeros(*x.shape[:-1], weight_q.shape[0])
    entry = dispatch.backend_entry(backend)
    own = entry.unpack(weight_q, packed) if packed and entry.unpack is not None else None
    return entry.run_folded(x, norm_scale, eps, weight_q, weight_scale, bias, own)


def _folded_fake(x, norm_scale, eps: float, weight_q, weight_scale, bias, packed: list, backend: str) -> torch.Tensor:
    _check_folded(x, norm_scale, eps, weight_q, weight_scale, bias)
    return x.new_empty(*x.shape[:-1], weight_q.shape[0])


def _sample_folded(gen: torch.Generator) -> Args:
    w_q = torch.randint(-127, 128, (17, 40), generator=gen, dtype=torch.int8)
    norm_scale = torch.rand(40, generator=gen) + 0.5
    return sample_rows(gen), norm_scale, 1e-5, w_q, torch.rand(17, generator=gen) / 100, None, [], "reference"


GENERIC_FOLDED = OpSpec(
        "w8a8_folded_norm_linear(Tensor x, Tensor norm_scale, float eps, Tensor weight_q, Tensor weight_scale, "
        "Tensor? bias, Tensor[] packed, str backend) -> Tensor",
        _folded_fake, _folded_impl, "reference.w8a8_linear_rmsnorm_reference", _sample_folded,
)  # fmt: skip
OPS: tuple[OpSpec, ...] = (*KERNEL_OPS, GENERIC_W8A8, GENERIC_FOLDED)
_LIB = register((GENERIC_W8A8, GENERIC_FOLDED), "FRAGMENT")  # kept for the process: dropping it would unregister the ops
