"""The one dispatch point for W8A8 linears: validate once, pick a backend from a table, call it.

Backends (all compute `ops/reference.py`'s scheme; see each module for its exactness):
  * "reference"    plain PyTorch, the oracle (any device);
  * "torch"        `torch._int_mm` (`ops/cpu.py`; CPU, and CUDA with M padded above 16);
  * "triton"       fused Triton kernel (`ops/triton_w8a8.py`; CUDA, or CPU under TRITON_INTERPRET=1);
  * "bitsandbytes" LLM.int8() primitives (`ops/bnb.py`; close to, not bit-identical with, the reference);
  * "cpu_fused"    fused C CPU kernel, AVX-512 VNNI or AVX2 build, same bits (`ops/cpu_fused.py`).
"auto" takes the first usable backend of `AUTO_PREFERENCE[device type]` (CUDA: triton, torch;
CPU: cpu_fused, torch; elsewhere: reference) and logs once, at warning level, why a faster one
was skipped. `ops/backend_report.py` lists every backend and kernel with the reason it cannot run.

Each row of the table says what a backend can do: run a linear, pack a weight once, run on a
packed weight without its own checks, and run a *folded* form (W8A8(RMSNorm(x)) from the norm's input, the norm
folded into the activation quantization; nn/norm_folded_linear.py). Weights are prepared once
(`prepare_w8a8`): validated, their backend resolved and packed, and the `quasar::` ops a module
calls (plain and folded) laid out.

Backends are imported lazily, so a missing optional package only matters when it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from quasar_hf.ops import backends
from quasar_hf.ops.fallback import warn_fallback_once
from quasar_hf.ops.validation import is_bound_linear_input, validate_w8a8_inputs, validate_weights

__all__ = [
    "AUTO_PREFERENCE",
    "BACKENDS",
    "Backend",
    "PreparedW8A8",
    "available_backends",
    "bind_w8a8_linear",
    "pack_weight_for",
    "prepare_w8a8",
    "resolve_backend",
    "validate_w8a8_inputs",
    "w8a8_linear",
]


def _device_type(device: str | torch.device | None) -> str:
    """'cpu' / 'cuda' / ... for a device spec; None means the default accelerator if any, else CPU."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


# ---- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """One W8A8 backend: when it can run, how it runs, and its optional once-per-weight steps.

    run(x, weight_q, weight_scale, bias, act_prescale, packed) -> y; pack(weight_q) -> a layout
    `run` reuses; run_prepacked: `run` for inputs already validated with `packed` from `pack`
    (skips the backend's own checks). packed_tensors(packed) / unpack(weight_q, tensors): the packed layout as tensors and back (the
    `quasar::w8a8_linear` op takes tensors). run_folded(x, norm_scale, eps, weight_q, weight_scale,
    bias, packed) -> W8A8(RMSNorm(x)) with the norm folded into the quantization (the bits of
    reference.w8a8_linear_rmsnorm_reference), what the generic `quasar::w8a8_folded_norm_linear` runs;
    fold_op(weights, packed) -> (op name, arguments after (x, norm_scale, eps)) where the backend has
    an op of its own; neither: this backend cannot fold. op_call(weights, packed) ->
    (op name, arguments after x): the `quasar::` op a prepared module calls, eager and compiled alike
    (None: the generic `quasar::w8a8_linear` with this backend's name and packed tensors).
    """

    name: str
    unavailable_reason: Callable[[str], str | None]
    run: Callable[..., torch.Tensor]
    pack: Callable[[torch.Tensor], object | None] | None = None
    run_prepacked: Callable[..., torch.Tensor] | None = None
    packed_tensors: Callable[[object], tuple[torch.Tensor, ...]] | None = None
    unpack: Callable[[torch.Tensor, list[torch.Tensor]], object] | None = None
    run_folded: Callable[..., torch.Tensor] | None = None
    fold_op: Callable[[tuple, object], tuple[str, tuple]] | None = None
    op_call: Callable[[tuple, object], tuple[str, tuple]] | None = None

    def __post_init__(self) -> None:
        if self.run_prepacked is None:
            object.__setattr__(self, "run_prepacked", self.run)


_TABLE: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("reference", backends.reference_unavailable, backends.run_reference, run_folded=backends.run_folded_reference),
        Backend(
            "torch",
            backends.torch_unavailable,
            backends.run_torch,
            pack=backends.pack_torch,
            packed_tensors=backends.packed_tensors_torch,
            unpack=backends.unpack_torch,
            run_folded=backends.run_folded_torch,
        ),
        Backend("triton", backends.triton_unavailable, backends.run_triton, run_folded=backends.run_folded_triton),
        Backend("bitsandbytes", backends.bnb_unavailable, backends.run_bnb),  # approximate numerics: no fold
        Backend(
            "cpu_fused",
            backends.cpu_fused_unavailable,
            backends.run_cpu_fused,
            pack=backends.pack_cpu_fused,
            run_prepacked=backends.run_cpu_fused_prepacked,
            packed_tensors=backends.packed_tensors_cpu_fused,
            unpack=backends.unpack_cpu_fused,
            fold_op=backends.fold_op_cpu_fused,
            op_call=backends.op_call_cpu_fused,
        ),
    )
}
BACKENDS = tuple(_TABLE)
# What "auto" tries, fastest first, per device type; "reference" closes every list.
AUTO_PREFERENCE: dict[str, tuple[str, ...]] = {"cuda": ("triton", "torch"), "cpu": ("cpu_fused", "torch")}


def backend_entry(name: str) -> Backend:
    """The table row of a concrete backend name (see resolve_backend)."""
    return _TABLE[name]


def _unavailable_reason(backend: str, device_type: str) -> str | None:
    """Why `backend` cannot run on `device_type`, or None when it can."""
    entry = _TABLE.get(backend)
    if entry is None:
        return f"unknown backend; choose one of {list(BACKENDS)} or 'auto'"
    return entry.unavailable_reason(device_type)


def _auto_choice(device_type: str) -> tuple[str, list[tuple[str, str]]]:
    """(the backend "auto" uses on `device_type`, [(faster backend skipped, why)])."""
    skipped = []
    for name in (*AUTO_PREFERENCE.get(device_type, ()), "reference"):
        reason = _unavailable_reason(name, device_type)
        if reason is None:
            return name, skipped
        skipped.append((name, reason))
    raise AssertionError("the reference backend is always available")


def available_backends(device: str | torch.device | None = None) -> list[str]:
    """Backends that can run on `device` (default: CUDA if present, else CPU), in BACKENDS order."""
    device_type = _device_type(device)
    return [name for name in BACKENDS if _unavailable_reason(name, device_type) is None]


def resolve_backend(backend: str, device: str | torch.device | None) -> str:
    """Concrete backend name for `backend` ("auto" or a name) on `device`; ValueError if it cannot run."""
    device_type = _device_type(device)
    if backend == "auto":
        name, skipped = _auto_choice(device_type)
        if skipped:
            first, reason = skipped[0]
            warn_fallback_once(f"the {first!r} W8A8 backend on {device_type}", f"{name!r}", reason)
        return name
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string such as 'auto' or 'torch', got {type(backend).__name__}")
    reason = _unavailable_reason(backend, device_type)
    if reason is not None:
        raise ValueError(
            f"W8A8 backend {backend!r} is not available on {device_type!r}: {reason}. "
            f"Available here: {available_backends(device_type)} (or 'auto')."
        )
    return backend


# ---- calling --------------------------------------------------------------------------------


def w8a8_linear(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
    backend: str = "auto",
    packed: object | None = None,
) -> torch.Tensor:
    """y = W8A8(x): x [..., K] (fp32/bf16/fp16) -> [..., N] in x.dtype.

    weight_q int8 [N, K], weight_scale fp32 [N], bias [N] or None, act_prescale fp32 [K] or None.
    `packed` is an opaque prepacked weight from `pack_weight_for`; a backend uses it only if it
    is of its own kind and ignores it otherwise. Under `torch.compile` this is the registered op
    `torch.ops.quasar.w8a8_linear` (see `ops/torch_ops.py`).
    """
    if torch.compiler.is_compiling():  # one opaque op in the graph (registered by ops/torch_ops.py)
        name = resolve_backend(backend, weight_q.device)
        return torch.ops.quasar.w8a8_linear(x, weight_q, weight_scale, bias, act_prescale, [], name)
    validate_w8a8_inputs(x, weight_q, weight_scale, bias, act_prescale)
    name = resolve_backend(backend, x.device)
    if x.numel() == 0:  # no rows: nothing to quantize
        return x.new_zeros(*x.shape[:-1], weight_q.shape[0])
    return _TABLE[name].run(x, weight_q, weight_scale, bias, act_prescale, packed)


def bind_w8a8_linear(
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
    backend: str = "auto",
    packed: object | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Validate the weights, resolve the backend and pack once; return `linear(x)` for these weights.

    The returned function computes exactly `w8a8_linear(x, weight_q, ...)` (same backend, same
    bits) but checks only x per call. Rebind whenever a weight tensor changes (W8A8Linear does).
    `packed`: `pack_weight_for(weight_q, backend)`, reused instead of packing again.
    """
    validate_weights(weight_q, weight_scale, bias, act_prescale)
    entry = _TABLE[resolve_backend(backend, weight_q.device)]
    if packed is None and entry.pack is not None:
        packed = entry.pack(weight_q)

    def bad_x(x: object) -> None:
        validate_w8a8_inputs(x, weight_q, weight_scale, bias, act_prescale)  # raises the precise error

    run = entry.run_prepacked if packed is not None and entry.pack is not None else entry.run  # weights checked above

    def fast(x: torch.Tensor) -> torch.Tensor:
        return run(x, weight_q, weight_scale, bias, act_prescale, packed)

    k, n, device = weight_q.shape[1], weight_q.shape[0], weight_q.device

    def linear(x: torch.Tensor) -> torch.Tensor:
        if not is_bound_linear_input(x, k, device):
            bad_x(x)
        if x.numel() == 0:
            return x.new_zeros(*x.shape[:-1], n)
        return fast(x)

    return linear


def pack_weight_for(weight_q: torch.Tensor, backend: str = "auto") -> object | None:
    """Prepacked weight for `backend` on weight_q's device, or None when that backend needs none.

    "torch" on CPU: a contiguous [K, N] copy for M > 1 calls (one extra int8 weight in memory);
    "cpu_fused": that module's packed layout. Call once per weight and pass the result to
    `w8a8_linear(..., packed=...)`.
    """
    entry = _TABLE[resolve_backend(backend, weight_q.device)]
    return entry.pack(weight_q) if entry.pack is not None else None


# ---- prepared once -------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedW8A8:
    """One weight validated, its backend resolved and its layout packed (`bind_w8a8_linear` gives a bound
    Python form for benchmarks and tests; modules call `op`).

    weights: (weight_q, weight_scale, bias, act_prescale) as prepared; packed_tensors: the packed
    layout as tensors (what the generic `quasar::w8a8_linear` op takes); op: (name, arguments after
    x) of the `quasar::` op a module calls for these weights (the backend's `op_call`); fold_op:
    (name, arguments after (x, norm_scale, eps)) of the op
    computing W8A8(RMSNorm(x)) with the norm folded in (None where the backend cannot fold or the
    weight has an act_prescale, which the fold's scale would replace).
    Holds the tensors it was prepared from: an in-place edit of them needs a new prepare_w8a8.
    """

    backend: str
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
    packed: object | None
    packed_tensors: tuple[torch.Tensor, ...]
    op: tuple[str, tuple]
    fold_op: tuple[str, tuple] | None = None


def prepare_w8a8(
    weight_q: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    act_prescale: torch.Tensor | None = None,
    backend: str = "auto",
) -> PreparedW8A8:
    """Validate, resolve the backend and pack once (the work W8A8Linear.prepare does)."""
    validate_weights(weight_q, weight_scale, bias, act_prescale)
    name = resolve_backend(backend, weight_q.device)
    entry = _TABLE[name]
    packed = entry.pack(weight_q) if entry.pack is not None else None
    tensors = entry.packed_tensors(packed) if packed is not None and entry.packed_tensors is not None else ()
    weights = (weight_q, weight_scale, bias, act_prescale)
    if entry.op_call is not None and packed is not None:
        op = entry.op_call(weights, packed)
    else:
        op = ("w8a8_linear", (*weights, tensors, name))
    return PreparedW8A8(name, weights, packed, tensors, op, _fold_op(entry, weights, packed, tensors))


def _fold_op(entry: Backend, weights: tuple, packed: object | None, tensors: tuple) -> tuple[str, tuple] | None:
    """The folded op for these weights, or None (no fold, or an act_prescale of their own)."""
    weight_q, weight_scale, bias, act_prescale = weights
    if act_prescale is not None:
        return None
    if entry.fold_op is not None and packed is not None:
        return entry.fold_op(weights, packed)
    if entry.run_folded is None:
        return None
    return "w8a8_folded_norm_linear", (weight_q, weight_scale, bias, tensors, entry.name)
