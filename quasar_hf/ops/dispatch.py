"""The one dispatch point for W8A8 linears: validate once, pick a backend from a table, call it.

Backends (all compute `ops/reference.py`'s scheme; see each module for its exactness):
  * "reference"    plain PyTorch, the oracle (any device);
  * "torch"        `torch._int_mm` (`ops/cpu.py`; CPU, and CUDA with M padded above 16);
  * "triton"       fused Triton kernel (`ops/triton_w8a8.py`; CUDA, or CPU under TRITON_INTERPRET=1);
  * "bitsandbytes" LLM.int8() primitives (`ops/bnb.py`; close to, not bit-identical with, the reference);
  * "cpu_fused"    fused C CPU kernel, AVX-512 VNNI or AVX2 build, same bits (`ops/cpu_fused.py`).
"auto" takes the first usable backend of `AUTO_PREFERENCE[device type]` (CUDA: triton, torch;
CPU: cpu_fused, torch; elsewhere: reference) and logs once, at warning level, why a faster one
was skipped. `backend_report()` lists every backend and kernel with the reason it cannot run.

Backends are imported lazily, so a missing optional package only matters when it is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from quasar_hf.ops.fallback import warn_fallback_once
from quasar_hf.ops.reference import w8a8_linear_reference
from quasar_hf.ops.validation import validate_w8a8_inputs, validate_weights, x_matches

__all__ = [
    "AUTO_PREFERENCE",
    "BACKENDS",
    "Backend",
    "BackendStatus",
    "available_backends",
    "backend_report",
    "bind_w8a8_linear",
    "pack_weight_for",
    "resolve_backend",
    "validate_w8a8_inputs",
    "w8a8_linear",
]


def _device_type(device: str | torch.device | None) -> str:
    """'cpu' / 'cuda' / ... for a device spec; None means the default accelerator if any, else CPU."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def _interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _cpu_fused_module():
    """The fused CPU kernel module if it can be imported (it is optional), else None."""
    try:
        return importlib.import_module("quasar_hf.ops.cpu_fused")
    except ImportError:
        return None


# ---- why each backend cannot run on a device type (None: it can) ----------------------------


def _reference_unavailable(device_type: str) -> str | None:
    return None


def _torch_unavailable(device_type: str) -> str | None:
    if not hasattr(torch, "_int_mm"):
        return "this torch build has no torch._int_mm (needs torch >= 2.2)"
    return None if device_type in ("cpu", "cuda") else f"torch._int_mm does not run on {device_type!r}"


def _triton_unavailable(device_type: str) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install 'quasar-hf[triton]')"
    if device_type == "cuda" or (device_type == "cpu" and _interpret_mode()):
        return None
    return f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU tests), got {device_type!r}"


def _bnb_unavailable(device_type: str) -> str | None:
    if importlib.util.find_spec("bitsandbytes") is None:
        return "the bitsandbytes package is not installed (pip install 'quasar-hf[bitsandbytes]')"
    return None if device_type in ("cpu", "cuda") else f"bitsandbytes int8 does not run on {device_type!r}"


def _cpu_fused_unavailable(device_type: str) -> str | None:
    if device_type != "cpu":
        return f"the fused C kernel runs on CPU tensors only, got {device_type!r}"
    module = _cpu_fused_module()
    if module is None:
        return "quasar_hf.ops.cpu_fused is not importable"
    return module.unavailable_reason()


# ---- how each backend runs (inputs validated; `packed` used only if it is the backend's own) ---


def _run_reference(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    return w8a8_linear_reference(x, weight_q, weight_scale, bias, act_prescale)


def _run_torch(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    from quasar_hf.ops.cpu import TorchPackedWeight, w8a8_linear_torch

    own = packed if isinstance(packed, TorchPackedWeight) else None
    return w8a8_linear_torch(x, weight_q, weight_scale, bias, act_prescale, packed=own)


def _run_triton(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    from quasar_hf.ops.triton_w8a8 import w8a8_linear_triton

    return w8a8_linear_triton(x, weight_q, weight_scale, bias, act_prescale)


def _run_bnb(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    from quasar_hf.ops.bnb import w8a8_linear_bnb

    return w8a8_linear_bnb(x, weight_q, weight_scale, bias, act_prescale)


def _run_cpu_fused(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    module = _cpu_fused_module()
    own = packed if isinstance(packed, module.PackedWeight) else None
    return module.w8a8_linear_cpu_fused(x, weight_q, weight_scale, bias=bias, act_prescale=act_prescale, packed=own)


def _pack_torch(weight_q: torch.Tensor) -> object | None:
    from quasar_hf.ops.cpu import prepare_cpu_weight

    return prepare_cpu_weight(weight_q) if weight_q.device.type == "cpu" else None


def _pack_cpu_fused(weight_q: torch.Tensor) -> object | None:
    return _cpu_fused_module().pack_weight(weight_q)


def _run_cpu_fused_prepacked(x, weight_q, weight_scale, bias, act_prescale, packed) -> torch.Tensor:
    return _cpu_fused_module().run_prepacked(x, weight_q, weight_scale, bias, act_prescale, packed)


def _bind_cpu_fused(weight_q, weight_scale, bias, act_prescale, packed, on_bad_x) -> Callable[[torch.Tensor], torch.Tensor]:
    return _cpu_fused_module().bind_linear(weight_q, weight_scale, bias, act_prescale, packed, on_bad_x)


# ---- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """One W8A8 backend: when it can run, how it runs, and its optional once-per-weight steps.

    run(x, weight_q, weight_scale, bias, act_prescale, packed) -> y; pack(weight_q) -> a layout
    `run` reuses; run_prepacked: `run` for inputs already validated with `packed` from `pack`
    (skips the backend's own checks); bind(weight_q, weight_scale, bias, act_prescale, packed,
    on_bad_x) -> linear(x) (when the backend has a faster bound form than `run`): it checks x as
    `x_matches` does, calls on_bad_x(x) (which raises) when that fails, and handles empty x.
    """

    name: str
    unavailable_reason: Callable[[str], str | None]
    run: Callable[..., torch.Tensor]
    pack: Callable[[torch.Tensor], object | None] | None = None
    bind: Callable[..., Callable[[torch.Tensor], torch.Tensor]] | None = None
    run_prepacked: Callable[..., torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.run_prepacked is None:
            object.__setattr__(self, "run_prepacked", self.run)


_TABLE: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("reference", _reference_unavailable, _run_reference),
        Backend("torch", _torch_unavailable, _run_torch, pack=_pack_torch),
        Backend("triton", _triton_unavailable, _run_triton),
        Backend("bitsandbytes", _bnb_unavailable, _run_bnb),
        Backend(
            "cpu_fused",
            _cpu_fused_unavailable,
            _run_cpu_fused,
            pack=_pack_cpu_fused,
            bind=_bind_cpu_fused,
            run_prepacked=_run_cpu_fused_prepacked,
        ),
    )
}
BACKENDS = tuple(_TABLE)
# What "auto" tries, fastest first, per device type; "reference" closes every list.
AUTO_PREFERENCE: dict[str, tuple[str, ...]] = {"cuda": ("triton", "torch"), "cpu": ("cpu_fused", "torch")}


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
        return torch.ops.quasar.w8a8_linear(x, weight_q, weight_scale, bias, act_prescale, backend)
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

    if entry.bind is not None:  # the backend's bound form checks x itself: no wrapper per call
        return entry.bind(weight_q, weight_scale, bias, act_prescale, packed, bad_x)

    def fast(x: torch.Tensor) -> torch.Tensor:
        return entry.run(x, weight_q, weight_scale, bias, act_prescale, packed)

    k, n, device = weight_q.shape[1], weight_q.shape[0], weight_q.device

    def linear(x: torch.Tensor) -> torch.Tensor:
        if not x_matches(x, k, device):
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


# ---- what can run here ----------------------------------------------------------------------


@dataclass(frozen=True)
class BackendStatus:
    """One row of `backend_report()`: a kernel backend on a device type, usable or not and why."""

    kernel: str  # "w8a8_linear" or "attention"
    name: str
    device: str
    usable: bool
    reason: str | None  # why it cannot run (None when usable)
    auto: bool  # what "auto" (or the attention interface) picks on this device


def backend_report() -> list[BackendStatus]:
    """Every W8A8 backend, row-stable attention and lm_head kernel on CPU and CUDA: usable or not, and why."""
    from quasar_hf.ops import attention_cpu, rowstable_linear, triton_attention

    rows = []
    no_cuda = None if torch.cuda.is_available() else "no CUDA device is visible to torch"
    for device_type, missing_device in (("cpu", None), ("cuda", no_cuda)):
        auto = None if missing_device else _auto_choice(device_type)[0]
        for name in BACKENDS:
            reason = missing_device or _unavailable_reason(name, device_type)
            rows.append(BackendStatus("w8a8_linear", name, device_type, reason is None, reason, name == auto))
    # Row-stable attention: the kernel where it runs, else SDPA with row-wise verification.
    for device_type, name, reason in (
        ("cpu", "rowstable_cpu", attention_cpu.unavailable_reason()),
        ("cuda", "rowstable_triton", no_cuda or triton_attention.unavailable_reason()),
    ):
        sdpa_reason = None if device_type == "cpu" else no_cuda
        rows.append(BackendStatus("attention", name, device_type, reason is None, reason, reason is None))
        rows.append(
            BackendStatus(
                "attention", "sdpa", device_type, sdpa_reason is None, sdpa_reason, reason is not None and sdpa_reason is None
            )
        )
    # The float lm_head of Quasar models: the row-stable C kernel on CPU, else F.linear.
    lm_head_reason = rowstable_linear.unavailable_reason()
    rows.append(BackendStatus("lm_head", "rowstable_cpu", "cpu", lm_head_reason is None, lm_head_reason, lm_head_reason is None))
    rows.append(BackendStatus("lm_head", "f_linear", "cpu", True, None, lm_head_reason is not None))
    rows.append(BackendStatus("lm_head", "f_linear", "cuda", no_cuda is None, no_cuda, no_cuda is None))
    return rows
