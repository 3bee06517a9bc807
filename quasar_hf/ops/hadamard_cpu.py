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

import functools
from collections.abc import Callable

import torch

from . import native
from .fallback import warn_fallback_once
from .hadamard import HadamardRotation, rotate_rows_reference

_DTYPES = (torch.float32, torch.bfloat16)


def unavailable_reason() -> str | None:
    """None when the kernel serves `quasar::hadamard_rows` here, else why not."""
    return native.unavailable_reason("hadamard")


def is_available() -> bool:
    """True if the kernel built, loaded and passed its smoke test. Never raises."""
    return unavailable_reason() is None


def fits(x: torch.Tensor, rotation: HadamardRotation) -> bool:
    """True if x is the kernel's kind: a CPU float32/bfloat16 tensor of rows of the rotation's width."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() >= 1 and x.shape[-1] == rotation.size


def rotate_rows(x: torch.Tensor, rotation: HadamardRotation) -> torch.Tensor:
    """x [..., K] -> fp32 [..., K] = x Q: the C kernel for CPU float32/bfloat16 rows, else the reference
    (the same bits either way)."""
    if not fits(x, rotation):
        return rotate_rows_reference(x, rotation)
    reason = unavailable_reason()
    if reason is not None:
        warn_fallback_once("the Hadamard CPU kernel", "its plain-PyTorch reference (same bits, slower)", reason)
        return rotate_rows_reference(x, rotation)
    return torch.ops.quasar.hadamard_rows.default(x, signs(rotation), rotation.blocks, rotation.pow2, rotation.scale)


@functools.lru_cache(maxsize=16)
def signs(rotation: HadamardRotation) -> torch.Tensor:
    """H_m as contiguous fp32 [m, m], built once per rotation and shared (read-only) by every caller."""
    return rotation.odd_signs().contiguous()


def bind_rotation(rotation: HadamardRotation) -> Callable[[torch.Tensor], torch.Tensor]:
    """`rotate_rows(x, rotation)` with the signs and sizes looked up once (a decode step rotates once per
    layer, so the per-call Python matters)."""
    if not is_available():
        return functools.partial(rotate_rows, rotation=rotation)
    k, args, op = (
        rotation.size,
        (signs(rotation), rotation.blocks, rotation.pow2, rotation.scale),
        torch.ops.quasar.hadamard_rows.default,
    )

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _DTYPES or x.device.type != "cpu" or x.dim() == 0 or x.shape[-1] != k:
            return rotate_rows(x, rotation)
        return op(x, *args)

    return rotate
