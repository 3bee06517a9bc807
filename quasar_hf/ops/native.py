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

SOURCE = CSRC / "native_ops.cpp"


def cxx_compiler() -> str | None:
    """$CXX, else g++, else c++ on PATH (what builds the library)."""
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
    compiler = cxx_compiler()
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
    """Each op the library implements, under its own `native_` name, against the op as registered so
    far (its fallback: the same C kernel through ctypes) on the op table's small ragged arguments: the
    same bits, or why not."""
    from quasar_hf.ops.torch_ops import OPS

    gen = torch.Generator().manual_seed(0)
    for op in (op for op in OPS if op.cpp):
        args = op.sample(gen)
        expected = getattr(torch.ops.quasar, op.name)(*args)
        actual = getattr(torch.ops.quasar, f"native_{op.name}")(*args)
        pairs = zip(expected, actual, strict=True) if isinstance(expected, list) else [(expected, actual)]
        if not all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs):
            return f"the C++ {op.name} disagrees with its fallback on a smoke test (compiler or ABI problem)"
    return None


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
