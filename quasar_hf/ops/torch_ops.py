"""Every kernel as a PyTorch operator (`torch.ops.quasar.*`), defined once here: its schema, its fake
(the shapes and errors a trace sees), its CUDA implementation and its CPU fallback. Eager modules
and compiled graphs call these operators alike; on CPU the dispatcher runs the C++ implementation
ops/native.py registers (the fallbacks run the same C kernels through ctypes where it cannot be built).

  quasar::w8a8_linear_cpu_packed(x, w_packed, wsum128, weight_scale, bias?, act_prescale?, out_features)
      -> [..., N]   (the "cpu_fused" backend: what its W8A8Linears call)
  quasar::w8a8_folded_norm_linears_cpu_packed(x, norm_weight, eps, offset, w_packed[], wsum128[],
      weight_scale[], bias?[], out_features[], emit_normed) -> [normed?, y_0, y_1, ...]   (an RMSNorm and
      the "cpu_fused" linears it feeds: eager FoldedRMSNorm, and ops/graph_passes.py in compiled steps)
  quasar::w8a8_linear(x, weight_q, weight_scale, bias?, act_prescale?, packed[], backend) -> [..., N]
      (every other backend: the one it names runs, on packed tensors made once when prepared)
  quasar::rowstable_attention(query, key, value, visible?, scale?) -> [B, Q, H, D]   (CPU: C; CUDA: Triton)
  quasar::rowstable_linear(x, weight, bias?) -> [..., N]   (the float lm_head, RowStableLinear)
  quasar::hadamard_rows(x, signs, blocks, pow2, scale) -> fp32 [..., K]   (RotatedW8A8Linear's input)
  quasar::rms_norm(x, weight, eps, offset, scale_in_float) -> [..., K]   (every RMSNorm when compiled;
      on CPU the row-stable C kernel of rms_norm_cpu.py, not the Transformers formula's bits)

Registered with `torch.library.Library` (define + impl + `register_fake`) rather than the
`torch.library.custom_op` decorator: both give the same operator, but the decorator's Python
wrapper (autograd and aliasing checks) costs ~20 us per call against ~4 us here. Inference only:
no autograd formulas.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quasar_hf.ops import dispatch
from quasar_hf.ops.validation import is_bound_linear_input, validate_w8a8_inputs

Args = tuple  # an op's positional arguments

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


# ---- quasar::w8a8_linear_cpu_packed: the "cpu_fused" backend's layout, what its modules call ---


def _w8a8_linear_cpu_packed_fallback(x, w_packed, wsum128, weight_scale, bias, act_prescale, out_features: int):
    """CPU without the C++ library: the same C kernel through ctypes (ops/cpu_fused.py)."""
    from quasar_hf.ops import cpu_fused

    packed = cpu_fused.PackedWeight(w_packed, wsum128, out_features, x.shape[-1])
    return cpu_fused.run_prepacked(x, None, weight_scale, bias, act_prescale, packed)


def _w8a8_linear_cpu_packed_fake(x, w_packed, wsum128, weight_scale, bias, act_prescale, out_features: int):
    k = x.shape[-1]
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or tuple(weight_scale.shape) != (out_features,):
        raise ValueError(
            f"w8a8_linear_cpu_packed: float x and weight_scale [{out_features}]; got {x.dtype}, {tuple(weight_scale.shape)}"
        )
    if w_packed.dim() != 4 or w_packed.shape[1] * 4 < k or w_packed.shape[1] * 4 >= k + 4:
        raise ValueError(f"w8a8_linear_cpu_packed: packed weight {tuple(w_packed.shape)} does not take rows of {k}")
    if (bias is not None and tuple(bias.shape) != (out_features,)) or (
        act_prescale is not None and tuple(act_prescale.shape) != (k,)
    ):
        raise ValueError(f"w8a8_linear_cpu_packed: bias must be [{out_features}] and act_prescale [{k}]")
    return x.new_empty(*x.shape[:-1], out_features)


# ---- row-stable attention: one op, an implementation per device ------------------------------


def _attention_fake(query, key, value, visible, scale) -> torch.Tensor:
    batch, heads, q_len, head_dim = query.shape
    return query.new_empty(batch, q_len, heads, head_dim)


def _attention_fallback_impl(query, key, value, visible, scale) -> torch.Tensor:
    """CPU without the C++ library: the same C kernel through ctypes (ops/attention_cpu.py)."""
    from quasar_hf.ops import attention_cpu

    return attention_cpu.rowstable_attention(query, key, value, visible, scale, kernel=attention_cpu.kernel())


def _attention_cuda_impl(query, key, value, visible, scale) -> torch.Tensor:
    from quasar_hf.ops import triton_attention

    return triton_attention.rowstable_attention_triton(query, key, value, visible, scale)


# ---- row-stable float linear (the lm_head) -------------------------------------------------


def _rowstable_linear_impl(x, weight, bias) -> torch.Tensor:
    from quasar_hf.ops import rowstable_linear

    return rowstable_linear.rowstable_linear(x, weight, bias)


def _rowstable_linear_fake(x, weight, bias) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# ---- Hadamard rotation of activation rows (RotatedW8A8Linear) --------------------------------


@functools.lru_cache(maxsize=64)
def _bound_rotation(size: int, blocks: int, odd_order: int, pow2: int):
    """The rotation's kernel call with its signs and sizes looked up once (a memo of a pure function)."""
    from quasar_hf.ops import hadamard, hadamard_cpu

    return hadamard_cpu.bind_rotation(hadamard.HadamardRotation(size, blocks, odd_order, pow2))


def _hadamard_rows_impl(x, signs, blocks: int, pow2: int, scale: float) -> torch.Tensor:
    """x Q (ops/hadamard.py), Q = I_blocks (x) (H_m (x) H_pow2) / sqrt(m pow2) with H_m = `signs`: the C
    kernel through ctypes for CPU rows without the C++ library, the elementwise reference elsewhere
    (this op's memo holds the same H_m as `signs`)."""
    return _bound_rotation(x.shape[-1], blocks, signs.shape[0], pow2)(x)


def _hadamard_rows_fake(x, signs, blocks: int, pow2: int, scale: float) -> torch.Tensor:
    odd_order = signs.shape[0]
    if x.shape[-1] != blocks * odd_order * pow2:
        raise ValueError(f"hadamard_rows: rows of {x.shape[-1]} do not match {blocks} x {odd_order} x {pow2}")
    if tuple(signs.shape) != (odd_order, odd_order) or signs.dtype != torch.float32:
        raise ValueError(f"hadamard_rows: signs must be fp32 [{odd_order}, {odd_order}], got {tuple(signs.shape)} {signs.dtype}")
    return x.new_empty(x.shape, dtype=torch.float32)


# ---- RMSNorm (RowStableRMSNorm, FoldedRMSNorm under compile) ---------------------------------


def _rms_norm_impl(x, weight, eps: float, offset: float, scale_in_float: bool) -> torch.Tensor:
    """CPU: the row-stable C kernel (rms_norm_cpu.py); elsewhere the Transformers formula. Contiguous,
    as the fake says (Gemma's q/k norms read transposed views)."""
    from quasar_hf.ops import rms_norm_cpu

    if x.device.type == "cpu":
        return rms_norm_cpu.rms_norm_rows(x, weight, eps, offset, scale_in_float)
    return _rms_norm_formula(x, weight, eps, offset, scale_in_float)


def _rms_norm_formula(x, weight, eps: float, offset: float, scale_in_float: bool) -> torch.Tensor:
    from quasar_hf.ops.reference import transformers_rms_norm_reference

    return transformers_rms_norm_reference(x, weight, eps, offset, scale_in_float).contiguous()


def _rms_norm_fake(x, weight, eps: float, offset: float, scale_in_float: bool) -> torch.Tensor:
    dtype = x.dtype if scale_in_float else torch.promote_types(weight.dtype, x.dtype)
    return x.new_empty(x.shape, dtype=dtype)


# ---- an RMSNorm folded into the "cpu_fused" W8A8 linears it feeds (written by ops/graph_passes.py) --


def _folded_cpu_packed_checked(x, norm_weight, w_packed, wsum128, weight_scale, bias, out_features) -> None:
    """The errors eager would raise (at trace time, through the fake), plus this op's own limits."""
    from quasar_hf.ops.cpu_fused_multi import MULTI_MAX

    count = len(out_features)
    if not 1 <= count <= MULTI_MAX or not count == len(w_packed) == len(wsum128) == len(weight_scale) == len(bias):
        raise ValueError(
            f"w8a8_folded_norm_linears_cpu_packed takes 1 to {MULTI_MAX} packed weights with sums, a scale and a bias (or None) each"
        )
    for packed, sums, scale, b, n in zip(w_packed, wsum128, weight_scale, bias, out_features):
        _w8a8_linear_cpu_packed_fake(x, packed, sums, scale, b, None, n)
    if tuple(norm_weight.shape) != (x.shape[-1],):
        raise ValueError(
            f"w8a8_folded_norm_linears_cpu_packed: norm weight {tuple(norm_weight.shape)} does not match rows of {x.shape[-1]}"
        )


def _folded_cpu_packed_fallback(
    x, norm_weight, eps: float, offset: float, w_packed, wsum128, weight_scale, bias, out_features, emit_normed: bool
):
    """CPU without the C++ library: the same C kernel through ctypes (ops/cpu_fused_multi.py)."""
    from quasar_hf.ops.cpu_fused import PackedWeight
    from quasar_hf.ops.cpu_fused_multi import folded_linears_prepacked

    k = x.shape[-1]
    packs = [PackedWeight(p, s, n, k) for p, s, n in zip(w_packed, wsum128, out_features)]
    norm_scale = (offset + norm_weight.float()).contiguous()  # what FoldedRMSNorm.prepare binds: offset + weight
    weights = [(None, s, b) for s, b in zip(weight_scale, bias)]
    return list(folded_linears_prepacked(x, weights, packs, norm_scale, eps, emit_normed))


def _folded_cpu_packed_fake(
    x, norm_weight, eps: float, offset: float, w_packed, wsum128, weight_scale, bias, out_features, emit_normed: bool
):
    _folded_cpu_packed_checked(x, norm_weight, w_packed, wsum128, weight_scale, bias, out_features)
    return [x.new_empty(x.shape)] * emit_normed + [x.new_empty(*x.shape[:-1], n) for n in out_features]


# ---- small ragged CPU arguments per op: the C++ library's smoke test and opcheck ---------------


def _packed(gen: torch.Generator, n: int, k: int = 40):
    from quasar_hf.ops.cpu_fused import pack_weight

    return pack_weight(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8))  # int8 [N, K] packed


def _rows(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(2, 3, 40, generator=gen).bfloat16()  # [B, S, K], K = 40: ragged for every vector width


def _sample_linear_cpu_packed(gen: torch.Generator) -> Args:
    pack = _packed(gen, 17)
    bias, prescale = torch.randn(17, generator=gen).bfloat16(), torch.rand(40, generator=gen) + 0.5
    return _rows(gen), pack.data, pack.wsum128, torch.rand(17, generator=gen) / 100, bias, prescale, 17


def _sample_folded(gen: torch.Generator) -> Args:
    packs = [_packed(gen, n) for n in (24, 17)]
    scales, biases = [torch.rand(n, generator=gen) / 100 for n in (24, 17)], [None, torch.randn(17, generator=gen).bfloat16()]
    x, norm = _rows(gen), torch.randn(40, generator=gen).bfloat16()
    return x, norm, 1e-5, 1.0, [p.data for p in packs], [p.wsum128 for p in packs], scales, biases, [24, 17], True


def _sample_linear(gen: torch.Generator) -> Args:
    w_q = torch.randint(-127, 128, (17, 40), generator=gen, dtype=torch.int8)
    return _rows(gen), w_q, torch.rand(17, generator=gen) / 100, None, None, [], "reference"


def _sample_attention(gen: torch.Generator) -> Args:
    q, k, v = (torch.randn(1, h, n, 8, generator=gen).bfloat16() for h, n in ((4, 3), (2, 5), (2, 5)))  # GQA
    visible = torch.rand(1, 3, 5, generator=gen) > 0.3
    visible[..., 0] = True
    return q, k, v, visible, 0.3


def _sample_rowstable_linear(gen: torch.Generator) -> Args:
    return _rows(gen), torch.randn(9, 40, generator=gen).bfloat16(), None


def _sample_rms_norm(gen: torch.Generator) -> Args:
    return _rows(gen), torch.randn(40, generator=gen).bfloat16(), 1e-6, 1.0, True


def _sample_hadamard(gen: torch.Generator) -> Args:
    from quasar_hf.ops.hadamard import HadamardRotation

    r = HadamardRotation.for_size(40)  # H_20 (x) H_2: the Paley mix and the butterflies
    return _rows(gen), r.odd_signs(), r.blocks, r.pow2, r.scale


# ---- the op table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpSpec:
    """One quasar:: operator: its schema, fake, Python implementations and oracle, in one place.

    fallback: the CompositeExplicitAutograd implementation, for CPU where csrc/native_ops.cpp is not
    built (the same C kernel through ctypes) and for devices without an implementation of their own;
    cuda: the CUDA one (Triton); cpp: csrc/native_ops.cpp implements it (registered for CPU once its
    smoke test passed, ops/native.py, and callable as `quasar::native_<name>` for that test);
    reference: the plain-PyTorch oracle its tests compare with; sample(generator): small ragged CPU
    arguments (the smoke test and opcheck).
    """

    schema: str
    fake: Callable[..., object]
    fallback: Callable[..., object]
    reference: str
    sample: Callable[[torch.Generator], Args]
    cuda: Callable[..., object] | None = None
    cpp: bool = False

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "w8a8_linear_cpu_packed(Tensor x, Tensor w_packed, Tensor wsum128, Tensor weight_scale, Tensor? bias, "
        "Tensor? act_prescale, int out_features) -> Tensor",
        _w8a8_linear_cpu_packed_fake, _w8a8_linear_cpu_packed_fallback, "reference.w8a8_linear_reference",
        _sample_linear_cpu_packed, cpp=True,
    ),
    OpSpec(
        "w8a8_folded_norm_linears_cpu_packed(Tensor x, Tensor norm_weight, float eps, float offset, Tensor[] w_packed, "
        "Tensor[] wsum128, Tensor[] weight_scale, Tensor?[] bias, int[] out_features, bool emit_normed) -> Tensor[]",
        _folded_cpu_packed_fake, _folded_cpu_packed_fallback, "reference.w8a8_folded_group_reference", _sample_folded,
        cpp=True,
    ),
    OpSpec(
        "w8a8_linear(Tensor x, Tensor weight_q, Tensor weight_scale, Tensor? bias, Tensor? act_prescale, "
        "Tensor[] packed, str backend) -> Tensor",
        _w8a8_linear_fake, _w8a8_linear_impl, "reference.w8a8_linear_reference", _sample_linear,
    ),
    OpSpec(
        "rowstable_attention(Tensor query, Tensor key, Tensor value, Tensor? visible, float? scale) -> Tensor",
        _attention_fake, _attention_fallback_impl, "reference.attention_reference", _sample_attention,
        cuda=_attention_cuda_impl, cpp=True,
    ),
    OpSpec(
        "rowstable_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
        _rowstable_linear_fake, _rowstable_linear_impl, "reference.rowstable_linear_reference",
        _sample_rowstable_linear, cpp=True,
    ),
    OpSpec(
        "rms_norm(Tensor x, Tensor weight, float eps, float offset, bool scale_in_float) -> Tensor",
        _rms_norm_fake, _rms_norm_impl, "reference.rowstable_rms_norm_reference", _sample_rms_norm,
        cuda=_rms_norm_formula, cpp=True,
    ),
    OpSpec(
        "hadamard_rows(Tensor x, Tensor signs, int blocks, int pow2, float scale) -> Tensor",
        _hadamard_rows_fake, _hadamard_rows_impl, "hadamard.rotate_rows_reference", _sample_hadamard, cpp=True,
    ),
)  # fmt: skip


def _register(ops: tuple[OpSpec, ...]) -> torch.library.Library:
    """Define every op of `ops` in the quasar namespace with its implementations and fake."""
    library = torch.library.Library("quasar", "DEF")
    for op in ops:
        library.define(op.schema)
        library.impl(op.name, op.fallback, "CompositeExplicitAutograd")
        if op.cuda is not None:
            library.impl(op.name, op.cuda, "CUDA")
        torch.library.register_fake(f"quasar::{op.name}", op.fake, lib=library)
    return library


_LIB = _register(OPS)  # kept for the process: dropping the Library object would unregister the ops
