"""The C++ library of the quasar:: operators' CPU implementations (`csrc/native_ops.cpp`): built, loaded,
checked and registered once per process.

ops/torch_ops.py defines each operator once, with its fake and its Python implementations: the CUDA
one and a CPU fallback that calls the same C kernel through ctypes. This library gives the CPU
dispatch key a C++ implementation instead, so eager modules and compiled graphs, which call the same
operators, reach the C kernels without Python:

  quasar::w8a8_linear_cpu_packed               (the "cpu_fused" W8A8 linear on its packed weight)
  quasar::w8a8_folded_norm_linears_cpu_packed  (an RMSNorm and the linears it feeds, one C call)
  quasar::rowstable_attention, quasar::rowstable_linear (the lm_head), quasar::rms_norm,
  quasar::hadamard_rows

It is built at first use with the C++ compiler (`$CXX`, else g++) against this torch's headers and
linked to the kernel libraries the ctypes fallbacks load (cpu_fused.py, attention_cpu.py,
rowstable_linear.py, rms_norm_cpu.py, hadamard_cpu.py: the build this CPU's flags chose; same cache as
the C kernels). Each function is first called under its own `native_` name and compared with the
fallback on a smoke test; only then are they registered for the operators. Where the library cannot
be had, `unavailable_reason()` says why, and the operators keep their fallbacks (the same bits, more
Python per call).
"""

from __future__ import annotations

import functools
import os
import shutil

import torch

from quasar_hf.ops import attention_cpu, cpu_fused, hadamard_cpu, rms_norm_cpu, rowstable_linear
from quasar_hf.ops.c_build import CSRC, build_and_load
from quasar_hf.ops.hadamard import HadamardRotation

SOURCE = CSRC / "native_ops.cpp"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _flags() -> tuple[str, ...]:
    from torch.utils.cpp_extension import include_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    version = "".join(ch if ch.isalnum() else "_" for ch in torch.__version__)
    includes = tuple(f"-I{path}" for path in include_paths())
    return ("-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DQUASAR_TORCH_{version}", *includes)


def _link(kernel_libraries: tuple[str, ...]) -> tuple[str, ...]:
    from torch.utils.cpp_extension import library_paths

    torch_lib = library_paths()[0]
    return (f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}", *kernel_libraries)


def _kernel_libraries() -> tuple[tuple[str, ...], str | None]:
    """The paths of the C kernel libraries the native ops call, or why they are unavailable."""
    if not cpu_fused.is_available():
        return (), f"the fused W8A8 kernel is unavailable: {cpu_fused.unavailable_reason()}"
    paths = [cpu_fused._library().lib.path]
    for library, what in (
        (attention_cpu._library, "row-stable attention"),
        (rowstable_linear._library, "row-stable linear"),
        (rms_norm_cpu._library, "row-stable RMSNorm"),
        (hadamard_cpu._library, "Hadamard rotation"),
    ):
        fn, reason = library()
        if fn is None:
            return (), f"the {what} kernel is unavailable: {reason}"
        paths.append(fn.library.path)  # the cached build the Python op calls (c_build.load_checked_entry)
    return tuple(paths), None


@functools.cache
def _load() -> str | None:
    """Build and load the library once per process and register the fakes: None, or why not."""
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found (install g++ or set $CXX)"
    libraries, reason = _kernel_libraries()
    if reason is not None:
        return reason
    try:
        build_and_load(SOURCE.name, _flags(), compiler, _link(libraries))
    except (RuntimeError, OSError) as err:
        return f"building the native ops failed: {err}"
    with torch.device("cpu"):  # the first use may fall inside a meta-device context (model loading)
        reason = _smoke_test()
    if reason is None:
        torch.ops.quasar.native_register_cpu_kernels()  # now the CPU implementations of the quasar:: ops
    return reason


def _smoke_test() -> str | None:
    """Each function of the library (under its own `native_` name) against the operator's fallback, which
    runs the same C kernel through ctypes, on small ragged shapes: the same bits, or why not."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=gen).bfloat16()  # [B, S, K], K = 40
    weights = [torch.randint(-128, 128, (n, 40), generator=gen, dtype=torch.int8) for n in (24, 17)]  # [N, K]
    scales = [torch.rand(n, generator=gen) / 100 for n in (24, 17)]
    biases = [None, torch.randn(17, generator=gen).bfloat16()]
    packs = [cpu_fused.pack_weight(w) for w in weights]
    norm, prescale = torch.randn(40, generator=gen).bfloat16(), torch.rand(40, generator=gen) + 0.5
    ops = torch.ops.quasar
    expected = ops.w8a8_linear_cpu_packed(x, packs[1].data, packs[1].wsum128, scales[1], biases[1], prescale, 17)
    actual = ops.native_w8a8_linear(x, packs[1].data, packs[1].wsum128, scales[1], biases[1], prescale, 17)
    group = (x, norm, 1e-5, 1.0, [p.data for p in packs], [p.wsum128 for p in packs], scales, biases, [24, 17], True)
    folded = ops.w8a8_folded_norm_linears_cpu_packed(*group)
    native_folded = ops.native_folded_norm_linears(*group)
    q, k, v = (torch.randn(1, h, n, 8, generator=gen).bfloat16() for h, n in ((4, 3), (2, 5), (2, 5)))
    visible = torch.rand(1, 3, 5, generator=gen) > 0.3
    visible[..., 0] = True
    attention = ops.rowstable_attention(q, k, v, visible, 0.3)  # the ctypes fallbacks: nothing registered yet
    native_attention = ops.native_rowstable_attention(q, k, v, visible, 0.3)
    head = torch.randn(9, 40, generator=gen).bfloat16()
    logits, native_logits = ops.rowstable_linear(x, head, None), ops.native_rowstable_linear(x, head, None)
    normed = ops.rms_norm(x, norm, 1e-6, 1.0, True)
    native_normed = ops.native_rms_norm(x, norm, 1e-6, 1.0, True)
    rotation = HadamardRotation.for_size(40)  # H_20 (x) H_2: the Paley mix and the butterflies
    rotated = ops.hadamard_rows(x, rotation.odd_signs(), rotation.blocks, rotation.pow2, rotation.scale)
    native_rotated = ops.native_hadamard_rows(x, rotation.odd_signs(), rotation.blocks, rotation.pow2, rotation.scale)
    same = (
        torch.equal(actual, expected)
        and all(map(torch.equal, folded, native_folded))
        and torch.equal(attention, native_attention)
        and torch.equal(logits, native_logits)
        and torch.equal(normed, native_normed)
        and torch.equal(rotated, native_rotated)
    )
    return None if same else "the native ops disagree with the Python ops on a smoke test (compiler or ABI problem)"


def unavailable_reason() -> str | None:
    """None when the native ops are loaded and checked, else why not. Never raises."""
    try:
        return _load()
    except Exception as err:  # noqa: BLE001 - this must never raise
        return f"unexpected error while loading the native ops: {err!r}"


def is_available() -> bool:
    """True if the library built, loaded, passed its smoke test and serves the operators on CPU (built
    and registered at the first call)."""
    return unavailable_reason() is None
