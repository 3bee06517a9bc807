"""The C kernels' operators (`torch.ops.quasar.*`), each defined once here: schema, fake (the shapes and
errors a trace sees), CUDA implementation, plain-PyTorch fallback, the C kernel whose C++
implementation serves it on CPU (ops/native.py registers it), oracle and small sample arguments.
ops/torch_ops.py adds the generic `quasar::w8a8_linear` (every other W8A8 backend) and is the table
of all of them.

  quasar::w8a8_linear_cpu_packed(x, w_packed, wsum128, weight_scale, bias?, act_prescale?, out_features)
      -> [..., N]   (the "cpu_fused" backend: what its W8A8Linears call)
  quasar::w8a8_folded_norm_linears_cpu_packed(x, norm_weight, eps, offset, w_packed[], wsum128[],
      weight_scale[], bias?[], out_features[], emit_normed) -> [normed?, y_0, y_1, ...]   (an RMSNorm folded
      into the packed linears it feeds: all of a norm's consumers in one call in compiled steps,
      ops/graph_passes.py; an eager consumer given the norm's input without its rows, with its own weight)
  quasar::rms_norm_quantize_rows(x, norm_scale, eps) -> [normed, q int8 [M, K], scale fp32 [M]]   (an eager
      FoldedRMSNorm on CPU: the norm's values and W8A8's quantization of them, the norm folded in)
  quasar::w8a8_linear_quantized_cpu_packed(like, q, scale, w_packed, wsum128, weight_scale, bias?, out_features)
      -> [..., N]   (a packed W8A8Linear given those rows: the GEMM and epilogue alone)
  quasar::rowstable_attention(query, key, value, visible?, scale?) -> [B, Q, H, D]   (CPU: C; CUDA: Triton)
  quasar::rowstable_linear(x, weight, bias?) -> [..., N]   (the float lm_head, RowStableLinear)
  quasar::hadamard_rows(x, signs, blocks, pow2, scale) -> fp32 [..., K]   (RotatedW8A8Linear's input)
  quasar::rms_norm(x, weight, eps, offset, scale_in_float) -> [..., K]   (every RMSNorm when compiled, and
      FoldedRMSNorm's values eager;
      on CPU the row-stable C kernel, csrc/rms_norm_rows.c, not the Transformers formula's bits)

The fallbacks (CompositeExplicitAutograd) serve where the C++ library cannot be built: the same bits
from the references, except attention's, which is the fp64 oracle rounded. Registered with
`torch.library.Library` (define + impl + `register_fake`) rather than the `torch.library.custom_op`
decorator: both give the same operator, but the decorator's Python wrapper (autograd and aliasing
checks) costs ~20 us per call against ~4 us here. Inference only: no autograd formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Args = tuple  # an op's positional arguments

# ---- quasar::w8a8_linear_cpu_packed: the "cpu_fused" backend's layout, what its modules call ---


def _w8a8_linear_cpu_packed_fallback(x, w_packed, wsum128, weight_scale, bias, act_prescale, out_features: int):
    """Without the C++ library: the reference on the unpacked weight (the kernel's bits, slowly)."""
    from quasar_hf.ops.cpu_packing import unpack_weight
    from quasar_hf.ops.reference import w8a8_linear_reference

    weight_q = unpack_weight(w_packed, out_features, x.shape[-1])
    return w8a8_linear_reference(x, weight_q, weight_scale, bias, act_prescale)


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
    """Without the C++ library: the fp64 oracle rounded to query's dtype (row-stable, not the kernel's bits)."""
    from quasar_hf.ops.reference import attention_reference

    return attention_reference(query, key, value, visible, scale).to(query.dtype).contiguous()


def _attention_cuda_impl(query, key, value, visible, scale) -> torch.Tensor:
    from quasar_hf.ops import triton_attention

    return triton_attention.rowstable_attention_triton(query, key, value, visible, scale)


# ---- row-stable float linear (the lm_head) -------------------------------------------------


def _rowstable_linear_impl(x, weight, bias) -> torch.Tensor:
    """Without the C++ library: the reference (the kernel's bits, slowly)."""
    from quasar_hf.ops.reference import rowstable_linear_reference

    return rowstable_linear_reference(x, weight, bias)


def _rowstable_linear_fake(x, weight, bias) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# ---- Hadamard rotation of activation rows (RotatedW8A8Linear) --------------------------------


def _hadamard_rows_impl(x, signs, blocks: int, pow2: int, scale: float) -> torch.Tensor:
    """x Q (ops/hadamard.py), Q = I_blocks (x) (H_m (x) H_pow2) / sqrt(m pow2) with H_m = `signs`:
    without the C++ library, the elementwise reference (the kernel's bits, slowly)."""
    from quasar_hf.ops.hadamard import HadamardRotation, rotate_rows_reference

    return rotate_rows_reference(x, HadamardRotation(x.shape[-1], blocks, signs.shape[0], pow2))


def _hadamard_rows_fake(x, signs, blocks: int, pow2: int, scale: float) -> torch.Tensor:
    odd_order = signs.shape[0]
    if x.shape[-1] != blocks * odd_order * pow2:
        raise ValueError(f"hadamard_rows: rows of {x.shape[-1]} do not match {blocks} x {odd_order} x {pow2}")
    if tuple(signs.shape) != (odd_order, odd_order) or signs.dtype != torch.float32:
        raise ValueError(f"hadamard_rows: signs must be fp32 [{odd_order}, {odd_order}], got {tuple(signs.shape)} {signs.dtype}")
    return x.new_empty(x.shape, dtype=torch.float32)


# ---- RMSNorm (RowStableRMSNorm under compile, FoldedRMSNorm always) -----------------------------


def _rms_norm_impl(x, weight, eps: float, offset: float, scale_in_float: bool) -> torch.Tensor:
    """CPU without the C++ library: the row-stable reference (the kernel's bits, slowly); other devices
    the Transformers formula. Contiguous, as the fake says (Gemma's q/k norms read transposed views)."""
    from quasar_hf.ops.reference import rowstable_rms_norm_reference

    if x.device.type == "cpu":
        return rowstable_rms_norm_reference(x, weight, eps, offset, scale_in_float).contiguous()
    return _rms_norm_formula(x, weight, eps, offset, scale_in_float)


def _rms_norm_formula(x, weight, eps: float, offset: float, scale_in_float: bool) -> torch.Tensor:
    from quasar_hf.ops.reference import transformers_rms_norm_reference

    return transformers_rms_norm_reference(x, weight, eps, offset, scale_in_float).contiguous()


def _rms_norm_fake(x, weight, eps: float, offset: float, scale_in_float: bool) -> torch.Tensor:
    dtype = x.dtype if scale_in_float else torch.promote_types(weight.dtype, x.dtype)
    return x.new_empty(x.shape, dtype=dtype)


# ---- an RMSNorm folded into the packed W8A8 linears it feeds (ops/graph_passes.py, eager consumers) ------


def _folded_cpu_packed_checked(x, norm_weight, w_packed, wsum128, weight_scale, bias, out_features) -> None:
    """The errors eager would raise (at trace time, through the fake), plus this op's own limits."""
    from quasar_hf.ops.cpu_packing import MULTI_MAX

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
    """Without the C++ library: the folded group's reference on the unpacked weights (the kernel's bits, slowly)."""
    from quasar_hf.ops.cpu_packing import unpack_weight
    from quasar_hf.ops.reference import w8a8_folded_group_reference

    _folded_cpu_packed_checked(x, norm_weight, w_packed, wsum128, weight_scale, bias, out_features)
    k = x.shape[-1]
    weights = [(unpack_weight(p, n, k), s, b) for p, n, s, b in zip(w_packed, out_features, weight_scale, bias)]
    norm_scale = offset + norm_weight.float()  # what the C++ implementation folds: offset + weight in fp32
    normed, *outs = w8a8_folded_group_reference(x, weights, norm_scale, eps)
    return [normed, *outs] if emit_normed else outs


def _folded_cpu_packed_fake(
    x, norm_weight, eps: float, offset: float, w_packed, wsum128, weight_scale, bias, out_features, emit_normed: bool
):
    _folded_cpu_packed_checked(x, norm_weight, w_packed, wsum128, weight_scale, bias, out_features)
    return [x.new_empty(x.shape)] * emit_normed + [x.new_empty(*x.shape[:-1], n) for n in out_features]


# ---- an RMSNorm's rows quantized once, and a packed linear on them (eager FoldedRMSNorm consumers) --------


def _rms_norm_quantize_fake(x, norm_scale, eps: float):
    k = x.shape[-1]
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or tuple(norm_scale.shape) != (k,):
        raise ValueError(f"rms_norm_quantize_rows: float rows x [..., {k}] and an fp32 norm_scale [{k}]")
    if not (eps >= 0.0 and eps < float("inf")):
        raise ValueError(f"rms_norm_quantize_rows: eps must be a finite number >= 0, got {eps!r}")
    rows = x.numel() // k if k else 0
    return [x.new_empty(x.shape), x.new_empty(rows, k, dtype=torch.int8), x.new_empty(rows, dtype=torch.float32)]


def _rms_norm_quantize_fallback(x, norm_scale, eps: float):
    """Without the C++ library: the references (the kernel's bits, slowly)."""
    from quasar_hf.ops.reference import rmsnorm_quantize_reference, rmsnorm_reference

    _rms_norm_quantize_fake(x, norm_scale, eps)
    return [rmsnorm_reference(x, norm_scale, eps), *rmsnorm_quantize_reference(x, norm_scale, eps)]


def _linear_quantized_fake(like, q, scale, w_packed, wsum128, weight_scale, bias, out_features: int):
    if q.dtype != torch.int8 or q.dim() != 2 or tuple(scale.shape) != (q.shape[0],) or like.shape[-1] != q.shape[1]:
        raise ValueError("w8a8_linear_quantized_cpu_packed: int8 rows q [M, K], fp32 scale [M] and like [..., K]")
    return _w8a8_linear_cpu_packed_fake(like, w_packed, wsum128, weight_scale, bias, None, out_features)


def _linear_quantized_fallback(like, q, scale, w_packed, wsum128, weight_scale, bias, out_features: int):
    """Without the C++ library: the reference on the unpacked weight (the kernel's bits, slowly)."""
    from quasar_hf.ops.cpu_packing import unpack_weight
    from quasar_hf.ops.reference import w8a8_linear_quantized_reference

    _linear_quantized_fake(like, q, scale, w_packed, wsum128, weight_scale, bias, out_features)
    weight_q = unpack_weight(w_packed, out_features, q.shape[1])
    return w8a8_linear_quantized_reference(like, q, scale, weight_q, weight_scale, bias)


# ---- small ragged CPU arguments per op: the C++ library's smoke test and opcheck ---------------


def _packed(gen: torch.Generator, n: int, k: int = 40):
    from quasar_hf.ops.cpu_packing import pack_weight

    return pack_weight(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8))  # int8 [N, K] packed


def sample_rows(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(2, 3, 40, generator=gen).bfloat16()  # [B, S, K], K = 40: ragged for every vector width


def _sample_linear_cpu_packed(gen: torch.Generator) -> Args:
    pack = _packed(gen, 17)
    bias, prescale = torch.randn(17, generator=gen).bfloat16(), torch.rand(40, generator=gen) + 0.5
    return sample_rows(gen), pack.data, pack.wsum128, torch.rand(17, generator=gen) / 100, bias, prescale, 17


def _sample_folded(gen: torch.Generator) -> Args:
    packs = [_packed(gen, n) for n in (24, 17)]
    scales, biases = [torch.rand(n, generator=gen) / 100 for n in (24, 17)], [None, torch.randn(17, generator=gen).bfloat16()]
    x, norm = sample_rows(gen), torch.randn(40, generator=gen).bfloat16()
    return x, norm, 1e-5, 1.0, [p.data for p in packs], [p.wsum128 for p in packs], scales, biases, [24, 17], True


def _sample_rms_norm_quantize(gen: torch.Generator) -> Args:
    x = sample_rows(gen)
    x[0, 1] = 0  # a zero row: scale 0
    return x, torch.rand(40, generator=gen) + 0.5, 1e-5


def _sample_linear_quantized(gen: torch.Generator) -> Args:
    from quasar_hf.ops.reference import rmsnorm_quantize_reference

    pack, x = _packed(gen, 17), sample_rows(gen)
    q, scale = rmsnorm_quantize_reference(x, torch.rand(40, generator=gen) + 0.5, 1e-5)
    bias = torch.randn(17, generator=gen).bfloat16()
    return x, q, scale, pack.data, pack.wsum128, torch.rand(17, generator=gen) / 100, bias, 17


def _sample_attention(gen: torch.Generator) -> Args:
    q, k, v = (torch.randn(1, h, n, 8, generator=gen).bfloat16() for h, n in ((4, 3), (2, 5), (2, 5)))  # GQA
    visible = torch.rand(1, 3, 5, generator=gen) > 0.3
    visible[..., 0] = True
    return q, k, v, visible, 0.3


def _sample_rowstable_linear(gen: torch.Generator) -> Args:
    return sample_rows(gen), torch.randn(9, 40, generator=gen).bfloat16(), None


def _sample_rms_norm(gen: torch.Generator) -> Args:
    return sample_rows(gen), torch.randn(40, generator=gen).bfloat16(), 1e-6, 1.0, True


def _sample_hadamard(gen: torch.Generator) -> Args:
    from quasar_hf.ops.hadamard import HadamardRotation

    r = HadamardRotation.for_size(40)  # H_20 (x) H_2: the Paley mix and the butterflies
    return sample_rows(gen), r.odd_signs(), r.blocks, r.pow2, r.scale


# ---- the op table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpSpec:
    """One quasar:: operator: its schema, fake, Python implementations and oracle, in one place.

    fallback: the CompositeExplicitAutograd implementation (plain PyTorch), for CPU where the C++
    library is not built or its kernel has no build here, and for devices without an implementation
    of their own; cuda: the CUDA one (Triton); kernel: the C kernel (csrc/kernel_builds.def) whose
    C++ implementation in csrc/native_ops.cpp serves the op on CPU, registered once its smoke test
    passed (ops/native.py; callable as `quasar::native_<name>` for that test); tolerance: 0 where the
    fallback has the kernel's bits, else the relative error the smoke test allows; reference: the
    plain-PyTorch oracle its tests compare with; sample(generator): small ragged CPU arguments (the
    smoke test and opcheck).
    """

    schema: str
    fake: Callable[..., object]
    fallback: Callable[..., object]
    reference: str
    sample: Callable[[torch.Generator], Args]
    cuda: Callable[..., object] | None = None
    kernel: str | None = None
    tolerance: float = 0.0

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


KERNEL_OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "w8a8_linear_cpu_packed(Tensor x, Tensor w_packed, Tensor wsum128, Tensor weight_scale, Tensor? bias, "
        "Tensor? act_prescale, int out_features) -> Tensor",
        _w8a8_linear_cpu_packed_fake, _w8a8_linear_cpu_packed_fallback, "reference.w8a8_linear_reference",
        _sample_linear_cpu_packed, kernel="w8a8",
    ),
    OpSpec(
        "w8a8_folded_norm_linears_cpu_packed(Tensor x, Tensor norm_weight, float eps, float offset, Tensor[] w_packed, "
        "Tensor[] wsum128, Tensor[] weight_scale, Tensor?[] bias, int[] out_features, bool emit_normed) -> Tensor[]",
        _folded_cpu_packed_fake, _folded_cpu_packed_fallback, "reference.w8a8_folded_group_reference", _sample_folded,
        kernel="w8a8",
    ),
    OpSpec(
        "rms_norm_quantize_rows(Tensor x, Tensor norm_scale, float eps) -> Tensor[]",
        _rms_norm_quantize_fake, _rms_norm_quantize_fallback, "reference.rmsnorm_quantize_reference",
        _sample_rms_norm_quantize, kernel="w8a8",
    ),
    OpSpec(
        "w8a8_linear_quantized_cpu_packed(Tensor like, Tensor q, Tensor scale, Tensor w_packed, Tensor wsum128, "
        "Tensor weight_scale, Tensor? bias, int out_features) -> Tensor",
        _linear_quantized_fake, _linear_quantized_fallback, "reference.w8a8_linear_quantized_reference",
        _sample_linear_quantized, kernel="w8a8",
    ),
    OpSpec(
        "rowstable_attention(Tensor query, Tensor key, Tensor value, Tensor? visible, float? scale) -> Tensor",
        _attention_fake, _attention_fallback_impl, "reference.attention_reference", _sample_attention,
        cuda=_attention_cuda_impl, kernel="attention", tolerance=2.0**-7,
    ),
    OpSpec(
        "rowstable_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
        _rowstable_linear_fake, _rowstable_linear_impl, "reference.rowstable_linear_reference",
        _sample_rowstable_linear, kernel="rowstable_linear",
    ),
    OpSpec(
        "rms_norm(Tensor x, Tensor weight, float eps, float offset, bool scale_in_float) -> Tensor",
        _rms_norm_fake, _rms_norm_impl, "reference.rowstable_rms_norm_reference", _sample_rms_norm,
        cuda=_rms_norm_formula, kernel="rms_norm",
    ),
    OpSpec(
        "hadamard_rows(Tensor x, Tensor signs, int blocks, int pow2, float scale) -> Tensor",
        _hadamard_rows_fake, _hadamard_rows_impl, "hadamard.rotate_rows_reference", _sample_hadamard, kernel="hadamard",
    ),
)  # fmt: skip


def register(ops: tuple[OpSpec, ...], kind: str) -> torch.library.Library:
    """Define every op of `ops` in the quasar namespace with its implementations and fake (kind: "DEF"
    for the namespace's first library, "FRAGMENT" after it)."""
    library = torch.library.Library("quasar", kind)
    for op in ops:
        library.define(op.schema)
        library.impl(op.name, op.fallback, "CompositeExplicitAutograd")
        if op.cuda is not None:
            library.impl(op.name, op.cuda, "CUDA")
        torch.library.register_fake(f"quasar::{op.name}", op.fake, lib=library)
    return library


_LIB = register(KERNEL_OPS, "DEF")  # kept for the process: dropping the Library object would unregister the ops
