"""Kernel-development harness: one C source (a build of csrc/kernel_builds.def, or a baseline file such
as the kernel before a change) built alone and called through ctypes, so the kernel benchmarks can
time builds and versions side by side in one process. The package never calls its kernels this way:
its C++ library links every build and serves the quasar:: ops (quasar_hf/ops/native.py).
"""

from __future__ import annotations

import ctypes
import math
import os
import re

import torch

from quasar_hf.ops.c_build import CSRC, PORTABLE_CFLAGS, CompileUnit, build_library, find_compiler, missing_cpu_flags
from quasar_hf.ops.native import ENTRY_POINTS, kernel_build_table

_SCALARS = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}  # every pointer is a void *


def entry_argtypes(entry: str) -> list:
    """The ctypes argument types of `entry`, read from its declaration in csrc/qhf_entry_points.h (the one
    place the kernels' C signatures are written): pointers as void *, int64_t, int and float as themselves."""
    declaration = re.search(rf"\bint {re.escape(entry)}\(([^)]*)\);", ENTRY_POINTS.read_text())
    if declaration is None:
        raise KeyError(f"csrc/qhf_entry_points.h declares no entry point {entry}")
    parameters = [" ".join(p.split()) for p in declaration.group(1).split(",")]
    return [ctypes.c_void_p if "*" in p else _SCALARS[p.removeprefix("const ").rsplit(" ", 1)[0]] for p in parameters]


DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def runnable_builds(kernel: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(build, source, compiler flags) of each build of `kernel` this CPU runs, best first."""
    return [
        (r.build, r.source, r.cflags) for r in kernel_build_table() if r.kernel == kernel and not missing_cpu_flags(r.cpu_flags)
    ]


def load_entry(source: str, entry: str, flags: tuple[str, ...]):
    """`entry` of csrc/<source> (or of a file at an absolute path, which includes csrc/'s headers) built
    alone with `flags`, as a ctypes function returning int."""
    stem = os.path.basename(source).removesuffix(".c")
    path = build_library(f"bench_{stem}", [CompileUnit(source, (*PORTABLE_CFLAGS, *flags))], (), find_compiler())
    fn = getattr(ctypes.CDLL(str(path)), entry)
    fn.restype, fn.argtypes = ctypes.c_int, entry_argtypes(entry)
    return fn


def attention(fn, query, key, value, visible, scale: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One call of a row-stable attention build: q [B, H, Q, D], k/v [B, KVH, N, D] with unit inner
    stride, visible uint8/bool [B, Q, N] or None -> out [B, Q, H, D] in q's dtype."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    out = torch.empty(batch, q_len, heads, head_dim, dtype=query.dtype) if out is None else out
    mask = (None, 0, 0) if visible is None else (visible.data_ptr(), visible.stride(0), visible.stride(1))
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    status = fn(
        query.data_ptr(), *query.stride()[:3], key.data_ptr(), *key.stride()[:3], value.data_ptr(), *value.stride()[:3],
        *mask, out.data_ptr(), batch, heads, kv_heads, q_len, kv_len, head_dim, scale, DTYPE_CODES[query.dtype],
        max(1, torch.get_num_threads()),
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"the attention build failed with status {status}")
    return out


def rowstable_linear(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One call of a row-stable linear build: x [M, K] @ weight[N, K].T (+ bias), both with unit inner stride."""
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    threads = max(1, min(torch.get_num_threads(), weight.numel() * weight.element_size() // (256 * 1024)))
    bias_ptr = None if bias is None else bias.data_ptr()
    status = fn(
        x.data_ptr(),
        x.stride(0),
        m,
        k,
        weight.data_ptr(),
        weight.stride(0),
        n,
        bias_ptr,
        out.data_ptr(),
        n,
        DTYPE_CODES[x.dtype],
        threads,
    )
    if status != 0:
        raise RuntimeError(f"the row-stable linear build failed with status {status}")
    return out


def hadamard(
    fn, x: torch.Tensor, rotation, signs: torch.Tensor, out: torch.Tensor | None = None, threads: int = 1
) -> torch.Tensor:
    """One call of a Hadamard build: contiguous rows x [M, K] -> fp32 x Q into `out` [M, K]."""
    count, width = x.shape
    out = torch.empty(count, width) if out is None else out
    args = (rotation.blocks, rotation.odd_order, rotation.pow2, signs.data_ptr(), rotation.scale, threads)
    if fn(x.data_ptr(), width, count, DTYPE_CODES[x.dtype], out.data_ptr(), *args):
        raise MemoryError("the Hadamard kernel could not allocate its scratch row")
    return out


__all__ = [
    "CSRC",
    "attention",
    "hadamard",
    "kernel_build_table",
    "load_entry",
    "missing_cpu_flags",
    "rowstable_linear",
    "runnable_builds",
]
