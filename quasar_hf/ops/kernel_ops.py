"""The C kernels' operators (`torch.ops.quasar.*`), each defined once here: schema, fake (the shapes and
errors a trace sees), CUDA implementation, plain-PyTorch fallback, the C kernel whose C++
implementation serves it on CPU (ops/native.py registers it), oracle and small sample arguments.
ops/torch_ops.py adds the generic `quasar::w8a8_linear` (every other W8A8 backend) and is the table
of all of them.

  quasar::w8a8_linear_cpu_packed(x, w_packed, wsum128, weight_scale, bias?, act_prescale?, out_features)
      -> [..., N]   (the "cpu_fused" backend: what its W8A8Linears call)
  quasar::w8a8_folded_norm_linear_cpu_packed(x, norm_scale, eps, w_packed, wsum128, weight_scale, bias?,
      out_features) -> [..., N]   (W8A8(RMSNorm(x)), the norm folded into the quantization: what a
      NormFoldedW8A8Linear calls on "cpu_fused", for the stacked q/k/v or gate/up weight)
  quasar::w8a8_accumulators_cpu_packed(x, w_packed, wsum128, act_prescale?, out_features) -> int32 [M, N]
      (the packed GEMM's exact accumulators, apart from the float epilogue: tests and debugging)
  quasar::rowstable_attention(query, key, value, visible?, scale?) -> [B, Q, H, D]   (CPU: C; CUDA: Triton)
  quasar::prefill_attention(query, key, value, scale?) -> [B, Q, H, D]   (a prompt's causal self-attention,
      or its continuation: the queries the last Q of N keys; bfloat16, on CPUs with AVX2 + FMA: what a long
      prefill, or a long prompt over a cache, runs; csrc/prefill_attention_bf16.c)
  quasar::rowstable_linear(x, weight, bias?) -> [..., N]   (the float lm_head, RowStableLinear)
  quasar::hadamard_rows(x, signs, blocks, pow2, scale) -> fp32 [..., K]   (RotatedW8A8Linear's input)
  quasar::rms_norm(x, weight, eps, offset, scale_in_float) -> [..., K]   (every RMSNorm not folded, when
      compiled; on CPU the row-stable C kernel, csrc/rms_norm_rows.c, not the Transformers formula's bits)

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


def _prefill_attention_fake(query, key, value, scale) -> torch.Tensor:
    batch, heads, length, head_dim = query.shape
    return query.new_empty(batch, length, heads, head_dim)


def _prefill_attention_fallback(query, key, value, scale) -> torch.Tensor:
    """Without the kernel: the fp64 oracle (bottom-right causal: query row i sees keys 0 .. N - Q + i),
    rounded. Slow and O(Q N) memory: callers ask `attention_cpu.prefill_supports` first and run SDPA
    where the kernel does not serve."""
    from quasar_hf.ops.reference import attention_reference

    return attention_reference(query, key, value, None, scale).to(query.dtype).contiguous()


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


# ---- RMSNorm (RowStableRMSNorm under compile; a NormFoldedW8A8Linear whose linear cannot fold) -----


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


# ---- W8A8(RMSNorm(x)) on the packed layout, the norm folded in (NormFoldedW8A8Linear) -----------


def _folded_cpu_packed_fake(x, norm_scale, eps: float, w_packed, wsum128, weight_scale, bias, out_features: int):
    k = x.shape[-1]
    if norm_scale.dtype != torch.float32 or tuple(norm_scale.shape) != (k,):
        raise ValueError(
            f"w8a8_folded_norm_linear_cpu_packed: norm_scale must be fp32 [{k}], got {norm_scale.dtype} {tuple(norm_scale.shape)}"
        )
    if not (eps >= 0.0 and eps < float("inf")):
        raise ValueError(f"w8a8_folded_norm_linear_cpu_packed: eps must be a finite number >= 0, got {eps!r}")
    return _w8a8_linear_cpu_packed_fake(x, w_packed, wsum128, weight_scale, bias, None, out_features)


def _folded_cpu_packed_fallback(x, norm_scale, eps: float, w_packed, wsum128, weight_scale, bias, out_features: int):
    """Without the C++ library: the reference on the unpacked weight (the kernel's bits, slowly)."""
    from quasar_hf.ops.cpu_packing import unpack_weight
    from quasar_hf.ops.reference import w8a8_linear_rmsnorm_reference

    _folded_cpu_packed_fake(x, norm_scale, eps, w_packed, wsum128, weight_scale, bias, out_features)
    weight_q = unpack_weight(w_packed, out_features, x.shape[-1])
    return w8a8_linear_rmsnorm_reference(x, norm_scale, eps, weight_q, weight_scale, bias)


# ---- the packed GEMM's exact int32 accumulators (tests) --------------------------------------


def _accumulators_fake(x, w_packed, wsum128, act_prescale, out_features: int):
    ones = x.new_ones(out_features, dtype=torch.float32)
    _w8a8_linear_cpu_packed_fake(x, w_packed, wsum128, ones, None, act_prescale, out_features)
    return x.new_empty(x.numel() // x.shape[-1] if x.shape[-1] else 0, out_features, dtype=torch.int32)


def _accumulators_fallback(x, w_packed, wsum128, act_prescale, out_features: int):
    """Without the C++ library: the per-token quantization and the exact int8 products of the reference."""
    from quasar_hf.ops.cpu_packing import unpack_weight
    from quasar_hf.ops.reference import int8_matmul_reference, quantize_per_token

    _accumulators_fake(x, w_packed, wsum128, act_prescale, out_features)
    rows = x.reshape(-1, x.shape[-1])
    a_q, _ = quantize_per_token(rows if act_prescale is None else rows.float() * act_prescale)
    return int8_matmul_reference(a_q, unpack_weight(w_packed, out_features, x.shape[-1]))


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
    pack, x = _packed(gen, 17), sample_rows(gen)
    x[0, 1] = 0  # a zero row: scale 0, the bias
    bias, norm_scale = torch.randn(17, generator=gen).bfloat16(), torch.rand(40, generator=gen) + 0.5
    return x, norm_scale, 1e-5, pack.data, pack.wsum128, torch.rand(17, generator=gen) / 100, bias, 17


def _sample_accumulators(gen: torch.Generator) -> Args:
    pack = _packed(gen, 17)
    return sample_rows(gen), pack.data, pack.wsum128, torch.rand(40, generator=gen) + 0.5, 17


def _sample_attention(gen: torch.Generator) -> Args:
    q, k, v = (torch.randn(1, h, n, 8, generator=gen).bfloat16() for h, n in ((4, 3), (2, 5), (2, 5)))  # GQA
    visible = torch.rand(1, 3, 5, generator=gen) > 0.3
    visible[..., 0] = True
    return q, k, v, visible, 0.3


def _sample_prefill_attention(gen: torch.Generator) -> Args:
    # GQA; the last 5 of 70 positions: ragged query and key blocks, keys of a second 64-key block
    q, k, v = (torch.randn(1, h, n, 32, generator=gen).bfloat16() for h, n in ((4, 5), (2, 70), (2, 70)))
    return q, k, v, 0.3


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
    passed (ops/native.py; withdrawn again if it fails); tolerance: 0 where the
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
        "w8a8_folded_norm_linear_cpu_packed(Tensor x, Tensor norm_scale, float eps, Tensor w_packed, Tensor wsum128, "
        "Tensor weight_scale, Tensor? bias, int out_features) -> Tensor",
        _folded_cpu_packed_fake, _folded_cpu_packed_fallback, "reference.w8a8_linear_rmsnorm_reference", _sample_folded,
        kernel="w8a8",
    ),
    OpSpec(
        "w8a8_accumulators_cpu_packed(Tensor x, Tensor w_packed, Tensor wsum128, Tensor? act_prescale, int out_features) -> Tensor",
        _accumulators_fake, _accumulators_fallback, "reference.int8_matmul_reference", _sample_accumulators, kernel="w8a8",
    ),
    OpSpec(
        "rowstable_attention(Tensor query, Tensor key, Tensor value, Tensor? visible, float? scale) -> Tensor",
        _attention_fake, _attention_fallback_impl, "reference.attention_reference", _sample_attention,
        cuda=_attention_cuda_impl, kernel="attention", tolerance=2.0**-7,
    ),
    OpSpec(
        "prefill_attention(Tensor query, Tensor key, Tensor value, float? scale) -> Tensor",
        _prefill_attention_fake, _prefill_attention_fallback, "reference.attention_reference", _sample_prefill_attention,
        kernel="prefill_attention", tolerance=2.0**-6,
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
