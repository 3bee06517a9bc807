"""The C++ library of the quasar:: operators' CPU implementations: built, loaded, checked and
registered once per process. It is the one place the CPU kernels are built and loaded.

ops/kernel_ops.py defines each operator once, with its fake, its CUDA implementation and a
plain-PyTorch fallback. This library (csrc/native_ops.cpp over the C kernels) gives the CPU
dispatch key a C++ implementation instead, so eager modules and compiled graphs, which call the
same operators, reach the C kernels without Python.

The library links every build of every C kernel that csrc/kernel_builds.def lists (each source
compiled with its ISA flags, its entry points renamed <entry>_<build>); at run time it picks, per
kernel, the best build this CPU runs (csrc/cpu_kernels.cpp), so one cached library serves every CPU
kind of a machine image. The library defines no operator schema: ops/kernel_ops.py defines each
once, and the library holds one table of the CPU implementations it has (`native_implemented_ops`).
Each operator whose kernel has a build here is registered, called on its sample and compared with
its fallback (a smoke test); one that disagrees is withdrawn again, so it never serves. Where
the library cannot be had, `unavailable_reason()` says why, and the operators keep their fallbacks
(the same bits for all but attention, much slower; modules then choose other backends).
"""

from __future__ import annotations

import functools
import os
import re
import threading
from dataclasses import dataclass, field

import torch

from quasar_hf.ops.c_build import CSRC, PORTABLE_CFLAGS, CompileUnit, build_library, find_compiler, is_x86_64
from quasar_hf.ops.kernel_ops import KERNEL_OPS

LIBRARY = "quasar_native_ops"
BUILDS_TABLE = CSRC / "kernel_builds.def"
ENTRY_POINTS = CSRC / "qhf_entry_points.h"


def macro_body(text: str, name: str) -> str:
    """The body of `#define name(...)` in C source `text`: its first line and every line a trailing
    backslash continues (the C preprocessor's own rule), or a KeyError naming the macro."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if re.match(rf"#define {re.escape(name)}\(", line)), None)
    if start is None:
        raise KeyError(f"no #define {name}(...) in the kernel tables")
    body = [lines[start].split(")", 1)[1]]
    while body[-1].rstrip().endswith("\\") and start + len(body) < len(lines):
        body.append(lines[start + len(body)])
    return " ".join(line.rstrip().removesuffix("\\") for line in body)


@functools.cache
def kernel_titles() -> dict[str, str]:
    """kernel name -> what doctor and errors call it: csrc/qhf_entry_points.h's QHF_KERNELS, the one list of kernels."""
    return dict(re.findall(r'X\((\w+), "([^"]*)"\)', macro_body(ENTRY_POINTS.read_text(), "QHF_KERNELS")))


@dataclass(frozen=True)
class KernelBuild:
    """One row of csrc/kernel_builds.def: `source` compiled with `cflags`, run where the CPU has `cpu_flags`."""

    kernel: str
    build: str
    source: str
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    x86_only: bool


def kernel_build_table() -> tuple[KernelBuild, ...]:
    """The rows of csrc/kernel_builds.def, best first per kernel (the x86-64 block, then the portable one)."""
    text = BUILDS_TABLE.read_text()
    rows = []
    pattern = r'QHF_BUILD\((\w+), (\w+), "([^"]*)",\s*"([^"]*)",\s*"([^"]*)"\)'
    for block, x86 in (("QHF_X86_BUILDS", True), ("QHF_PORTABLE_BUILDS", False)):
        for kernel, build, source, cflags, cpu_flags in re.findall(pattern, macro_body(text, block)):
            rows.append(KernelBuild(kernel, build, source, tuple(cflags.split()), tuple(cpu_flags.split()), x86))
    return tuple(rows)


def _entry_points() -> tuple[str, ...]:
    """Every C entry point of every kernel (csrc/qhf_entry_points.h's QHF_ENTRIES_<kernel> lists)."""
    text = ENTRY_POINTS.read_text()
    return tuple(
        e for kernel in kernel_titles() for e in re.findall(r"X\((qhf_\w+), b\)", macro_body(text, f"QHF_ENTRIES_{kernel}"))
    )


def cxx_standard(torch_version: str) -> str:
    """The C++ standard torch's headers need: C++20 from torch 2.14 (its headers use `requires`), else C++17."""
    major, minor = (int(part) for part in re.findall(r"\d+", torch_version)[:2])
    return "c++20" if (major, minor) >= (2, 14) else "c++17"


def torch_folder(*parts: str) -> str:
    """A folder of the installed torch package (its headers, its libraries). Computed from torch's own path,
    not through torch.utils.cpp_extension, which imports setuptools: where pip imported the standard
    library's distutils first, that import fails, and loading a cached build must never depend on it."""
    return os.path.join(os.path.dirname(torch.__file__), *parts)


def _cxx_flags() -> tuple[str, ...]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    version = "".join(ch if ch.isalnum() else "_" for ch in torch.__version__)
    x86 = ("-DQHF_X86",) if is_x86_64() else ()
    includes = (f"-I{torch_folder('include')}", f"-I{torch_folder('include', 'torch', 'csrc', 'api', 'include')}")
    return (
        "-O2",
        "-fPIC",
        f"-std={cxx_standard(torch.__version__)}",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DQUASAR_TORCH_{version}",
        *x86,
        *includes,
    )


def compile_units() -> list[CompileUnit]:
    """The library's objects: each kernel build this machine's compiler targets, then the C++ files."""
    entries = _entry_points()
    units = []
    for row in kernel_build_table():
        if row.x86_only and not is_x86_64():
            continue
        renames = tuple(f"-D{entry}={entry}_{row.build}" for entry in entries)
        units.append(CompileUnit(row.source, (*PORTABLE_CFLAGS, *row.cflags, *renames)))
    return units + [CompileUnit(name, _cxx_flags()) for name in ("cpu_kernels.cpp", "native_ops.cpp")]


def _link() -> tuple[str, ...]:
    torch_lib = torch_folder("lib")
    return (f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}")


@dataclass(frozen=True)
class _Loaded:
    """The library's state in this process: why it is unavailable, the builds it chose, each op's status."""

    error: str | None
    builds: dict[str, tuple[str, str]]  # kernel -> (build, source)
    op_errors: dict[str, str]  # op name -> why its C++ implementation does not serve it (absent: it does)
    kernel_reasons: dict[str, str | None] = field(default_factory=dict, compare=False)  # unavailable_reason's answers


@functools.cache
def _load() -> _Loaded:
    """Build and load the library once per process, smoke-test and register each op it can serve."""
    try:
        path = build_library(LIBRARY, compile_units(), _link(), find_compiler())
        torch.ops.load_library(str(path))
    except (RuntimeError, OSError) as err:
        return _Loaded(f"building the C++ kernels failed: {err}", {}, {})
    builds = {}
    for line in torch.ops.quasar.native_kernel_builds():
        kernel, build, source = line.split()
        builds[kernel] = (build, source)
    implemented = set(torch.ops.quasar.native_implemented_ops())
    op_errors = {}
    with torch.device("cpu"):  # the first use may fall inside a meta-device context (model loading)
        for op in (op for op in KERNEL_OPS if op.kernel):
            if op.name not in implemented:
                op_errors[op.name] = f"the C++ library has no implementation of quasar::{op.name}"
            elif op.kernel not in builds:
                op_errors[op.name] = f"no build of the {kernel_titles()[op.kernel]} kernel runs on this CPU ({_needs(op.kernel)})"
            else:
                torch.ops.quasar.native_register_cpu_kernel(op.name)
                if (mismatch := _smoke_test(op)) is not None:
                    torch.ops.quasar.native_unregister_cpu_kernel(op.name)
                    op_errors[op.name] = mismatch
    return _Loaded(None, builds, op_errors)


def _needs(kernel: str) -> str:
    """The CPU flags of each build of `kernel` that this machine's library has, in words."""
    rows = [r for r in kernel_build_table() if r.kernel == kernel and (is_x86_64() or not r.x86_only)]
    return "needs " + " or ".join(" + ".join(r.cpu_flags) for r in rows) if rows else "no build for this architecture"


def _smoke_test(op, candidate=None) -> str | None:
    """`candidate` (default: the op, which the dispatcher sends to its registered C++ implementation on
    CPU) against the op's plain-PyTorch fallback on its small ragged sample: the same bits (within
    `op.tolerance` for attention, whose fallback is the fp64 oracle), or why not."""
    args = op.sample(torch.Generator().manual_seed(0))
    expected = op.fallback(*args)
    actual = (candidate or getattr(torch.ops.quasar, op.name))(*args)
    pairs = zip(expected, actual, strict=True) if isinstance(expected, list) else [(expected, actual)]
    for a, b in pairs:
        same = a.dtype == b.dtype and a.shape == b.shape
        if same and op.tolerance:
            same = bool(((a.double() - b.double()).abs() <= op.tolerance * (1 + a.double().abs())).all())
        elif same:
            same = torch.equal(a, b)
        if not same:
            return f"the C++ {op.name} disagrees with its reference on a smoke test (compiler problem)"
    return None


_FIRST_LOAD = threading.RLock()  # two threads asking first build and register once


def _loaded() -> _Loaded:
    try:
        with _FIRST_LOAD:
            return _load()
    except Exception as err:  # noqa: BLE001 - availability questions must never raise
        return _Loaded(f"unexpected error while loading the C++ kernels: {err!r}", {}, {})


def unavailable_reason(kernel: str | None = None) -> str | None:
    """None when the library is loaded (and, given a kernel name of kernel_titles(), that kernel has a checked
    build here), else why not. Never raises."""
    loaded = _loaded()
    if loaded.error is not None or kernel is None:
        return loaded.error
    if kernel not in loaded.kernel_reasons:  # asked by every attention call of an eager step: answered once
        loaded.kernel_reasons[kernel] = _kernel_unavailable_reason(loaded, kernel)
    return loaded.kernel_reasons[kernel]


def _kernel_unavailable_reason(loaded: _Loaded, kernel: str) -> str | None:
    if kernel not in loaded.builds:
        return f"no build of the {kernel_titles()[kernel]} kernel runs on this CPU ({_needs(kernel)})"
    failed = [loaded.op_errors[op.name] for op in KERNEL_OPS if op.kernel == kernel and op.name in loaded.op_errors]
    return failed[0] if failed else None


def is_available(kernel: str | None = None) -> bool:
    """True if the library built, loaded and (for `kernel`) serves that kernel's operators on CPU."""
    return unavailable_reason(kernel) is None


def kernel_builds() -> dict[str, tuple[str, str]]:
    """kernel -> (build, source) of the build each kernel runs on this CPU (empty without the library)."""
    return dict(_loaded().builds)


def op_unavailable_reason(name: str) -> str | None:
    """Why the C++ implementation does not serve quasar::<name> on CPU (None: it does)."""
    loaded = _loaded()
    return loaded.error or loaded.op_errors.get(name)
