"""Hadamard rotation of activation rows on CPU (C, built at first use): `rotate_rows_reference`'s bits, fast.

csrc/hadamard_rows.c applies the same butterflies, +-1 mixes and scaling in the same order as
the plain-PyTorch oracle in ops/hadamard.py, so the two agree bit for bit on every CPU (each
element's sequence of fp32 operations is fixed; vectorization only runs elements side by side).
The AVX-512 and AVX2 builds (csrc/hadamard_rows_avx512.c, csrc/hadamard_rows_avx2.c) and the portable
build compute the same bits.

Public API:
    unavailable_reason() -> str | None / is_available() -> bool     never raise
    fits(x, rotation) -> bool                                        CPU, float32/bfloat16, width K
    rotate_rows(x, rotation) -> fp32 [..., K]                        C kernel here, reference elsewhere
    bind_rotation(rotation) -> rotate(x)                             the same, constants bound once
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from .c_build import PORTABLE_CFLAGS, load_checked_entry, missing_cpu_flags
from .fallback import warn_fallback_once
from .hadamard import HadamardRotation, rotate_rows_reference

# Variants, best first: (source, extra compiler flags, CPU flags they need). All compute the same bits.
VARIANTS = (
    ("hadamard_rows_avx512.c", ("-mavx512f",), ("avx512f",)),
    ("hadamard_rows_avx2.c", ("-mavx2", "-mfma"), ("avx2", "fma")),
    ("hadamard_rows.c", (), ()),
)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_MIN_ROWS_PER_THREAD = 64  # decode and verify steps (1-8 rows) stay on one thread
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _I64, _I64, _INT, _P, _I64, _I64, _I64, _P, _F, _INT]


@functools.lru_cache(maxsize=1)
def _library() -> tuple[object | None, str | None]:
    """(entry point, None) for the best variant this CPU runs, or (None, why the kernel is unavailable)."""
    reasons = []
    for source, flags, required in VARIANTS:
        if missing_cpu_flags(required):
            continue
        fn, reason = load_variant(source, flags)
        if fn is not None:
            return fn, None
        reasons.append(reason)
    return None, "; ".join(reasons) or "no variant of the Hadamard kernel runs on this CPU"


def load_variant(source: str, flags: tuple[str, ...]) -> tuple[object | None, str | None]:
    """Build csrc/<source> with `flags`, load it and smoke-test it (tests load each variant)."""
    return load_checked_entry(
        source, "qhf_hadamard_rows", PORTABLE_CFLAGS + flags, _ARGTYPES, _smoke_test, "Hadamard rotation kernel"
    )


def _smoke_test(fn) -> str | None:
    """A Paley-times-Sylvester width and a block-diagonal one against the reference, bit for bit."""
    gen = torch.Generator(device="cpu").manual_seed(0)  # explicit CPU: first use may fall inside a meta-device context
    for width in (12 * 16, 20 * 4, 6):  # H_12 (x) H_16 (vector paths), H_20 (x) H_4 and 3 blocks of H_2 (scalar)
        rotation = HadamardRotation.for_size(width)
        x = torch.randn(3, width, generator=gen, device="cpu").bfloat16()
        if not torch.equal(_run(fn, x, rotation), rotate_rows_reference(x, rotation)):
            return "the built Hadamard kernel disagrees with ops/hadamard.py on a smoke test (compiler problem)"
    return None


def unavailable_reason() -> str | None:
    """None when the kernel can run here, else why not."""
    try:
        return _library()[1]
    except Exception as err:  # noqa: BLE001 - this must never raise
        return f"unexpected error while loading the Hadamard rotation kernel: {err!r}"


def is_available() -> bool:
    """True if the kernel built, loaded and passed its smoke test. Never raises."""
    return unavailable_reason() is None


def fits(x: torch.Tensor, rotation: HadamardRotation) -> bool:
    """True if x is the kernel's kind: a CPU float32/bfloat16 tensor of rows of the rotation's width."""
    return x.device.type == "cpu" and x.dtype in _DTYPE_CODES and x.dim() >= 1 and x.shape[-1] == rotation.size


def rotate_rows(x: torch.Tensor, rotation: HadamardRotation) -> torch.Tensor:
    """x [..., K] -> fp32 [..., K] = x Q: the C kernel for CPU float32/bfloat16 rows, else the reference
    (the same bits either way)."""
    if not fits(x, rotation):
        return rotate_rows_reference(x, rotation)
    fn, reason = _library()
    if fn is None:
        warn_fallback_once("the Hadamard CPU kernel", "its plain-PyTorch reference (same bits, slower)", reason)
        return rotate_rows_reference(x, rotation)
    return _run(fn, x, rotation)


@functools.lru_cache(maxsize=16)
def signs(rotation: HadamardRotation) -> torch.Tensor:
    """H_m as contiguous fp32 [m, m], built once per rotation and shared (read-only) by every caller."""
    return rotation.odd_signs().contiguous()


def bind_rotation(rotation: HadamardRotation) -> Callable[[torch.Tensor], torch.Tensor]:
    """`rotate_rows(x, rotation)` with the kernel, the signs and the sizes looked up once (a decode step
    rotates once per layer, so the per-call Python matters)."""
    fn, reason = _library()
    if fn is None:
        return functools.partial(rotate_rows, rotation=rotation)
    k, blocks, m, n, scale = rotation.size, rotation.blocks, rotation.odd_order, rotation.pow2, rotation.scale
    odd = signs(rotation)
    signs_ptr = odd.data_ptr()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        code = _DTYPE_CODES.get(x.dtype)
        if code is None or x.device.type != "cpu" or x.dim() == 0 or x.shape[-1] != k:
            return rotate_rows(x, rotation)
        if not x.is_contiguous():  # the common case passes x as it is: views cost microseconds here
            x = x.contiguous()
        count = x.numel() // k
        out = torch.empty(x.shape, dtype=torch.float32, device="cpu")
        if count:
            threads = 1 if count < 2 * _MIN_ROWS_PER_THREAD else min(torch.get_num_threads(), count // _MIN_ROWS_PER_THREAD)
            if fn(x.data_ptr(), k, count, code, out.data_ptr(), blocks, m, n, signs_ptr, scale, threads):
                raise MemoryError(f"the Hadamard kernel could not allocate a scratch row of {k} floats")
        return out

    rotate.signs = odd  # keeps the tensor behind signs_ptr alive with the closure
    return rotate


def _run(fn, x: torch.Tensor, rotation: HadamardRotation) -> torch.Tensor:
    """The kernel call: rows need unit inner stride (copied if not)."""
    k = rotation.size
    rows = x.reshape(-1, k)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(rows.shape[0], k, dtype=torch.float32, device="cpu")
    if out.numel():
        threads = max(1, min(torch.get_num_threads(), rows.shape[0] // _MIN_ROWS_PER_THREAD))
        odd = signs(rotation)
        status = fn(
            rows.data_ptr(),
            rows.stride(0),
            rows.shape[0],
            _DTYPE_CODES[x.dtype],
            out.data_ptr(),
            rotation.blocks,
            rotation.odd_order,
            rotation.pow2,
            odd.data_ptr(),
            rotation.scale,
            threads,
        )
        if status != 0:
            raise MemoryError(f"the Hadamard kernel could not allocate a scratch row of {k} floats")
    return out.reshape(*x.shape[:-1], k)
