"""Build a C kernel from `ops/csrc/` at first use and load it with ctypes (shared by the CPU kernels).

Libraries go to a per-user cache (`$QUASAR_HF_KERNEL_CACHE`, else `$XDG_CACHE_HOME/quasar_hf/kernels`,
else `~/.cache/quasar_hf/kernels`), keyed by a hash of source + compiler + flags, so editing a
source or upgrading the package rebuilds. Builds hold an exclusive file lock per key folder and
publish the library by atomic rename, so concurrent processes never see a half-written file;
under the lock, temporary files left by a crashed compile and empty or unloadable libraries are
removed and rebuilt.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from quasar_hf.locking import exclusive_lock

CSRC = Path(__file__).parent / "csrc"
# Never -ffast-math; -ffp-contract=off forbids FMA contraction (both would change rounding).
PORTABLE_CFLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math")
TEMP_PREFIX = "tmp"  # compiles write <folder>/tmp*.so, then rename it onto the library


MASK_ENV = "QUASAR_HF_CPU_FLAGS_OFF"  # e.g. "avx512f,avx512_vnni": build and run as on a CPU without them


def masked_cpu_flags() -> set[str]:
    """CPU flags that `$QUASAR_HF_CPU_FLAGS_OFF` (comma-separated /proc/cpuinfo names) says to treat as absent.

    Lets one machine run the kernels' tests as a CPU with fewer features would: the portable builds,
    and the fallbacks chosen where a kernel needs a masked flag."""
    return {flag.strip() for flag in os.environ.get(MASK_ENV, "").split(",") if flag.strip()}


def missing_cpu_flags(required: tuple[str, ...]) -> list[str]:
    """CPU flags in `required` that /proc/cpuinfo does not list, or that are masked (all of them off
    x86-64 or if /proc/cpuinfo is unreadable)."""
    if not required:
        return []
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return list(required)
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return list(required)
    flags_line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    flags = set(flags_line.split(":", 1)[-1].split()) - masked_cpu_flags()
    return [f for f in required if f not in flags]


def cache_dir() -> Path:
    """Where built kernels live (created on demand)."""
    root = os.environ.get("QUASAR_HF_KERNEL_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "quasar_hf" / "kernels"


def find_compiler() -> str | None:
    """$CC, else gcc, else cc on PATH."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


class KernelLibrary(ctypes.CDLL):
    """A loaded kernel library that knows its file (`path`: what the C++ ops link to, ops/native.py)."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = str(path)


def _compile(compiler: str, source: Path, flags: tuple[str, ...], target: Path, link: tuple[str, ...] = ()) -> None:
    """Compile `source` into `target` atomically (temp file + rename; safe across processes); `link`
    goes after the source (libraries it needs)."""
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, str(source), *link, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{done.stderr.strip()[-2000:]}")
        if os.path.getsize(tmp) == 0:
            raise RuntimeError(f"`{' '.join(cmd)}` wrote an empty library")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _remove_stale(folder: Path, target: Path) -> None:
    """Temporary files of crashed compiles, and `target` if it is empty (only called under the lock)."""
    for stray in folder.glob(f"{TEMP_PREFIX}*.so"):
        stray.unlink(missing_ok=True)
    if target.exists() and target.stat().st_size == 0:
        target.unlink()


def _require_writable(folder: Path) -> None:
    """Create `folder`; a clear error naming it (and the variable that moves it) when that fails."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        writable = os.access(folder, os.W_OK | os.X_OK)
    except OSError as err:
        writable, reason = False, err.strerror or str(err)
    else:
        reason = "not writable"
    if not writable:
        raise RuntimeError(
            f"cannot write the kernel cache folder {folder} ({reason}); set QUASAR_HF_KERNEL_CACHE to a writable folder"
        )


def _load_or_build(
    compiler: str, source: Path, flags: tuple[str, ...], target: Path, link: tuple[str, ...] = ()
) -> KernelLibrary:
    """The library at `target`, compiled first (under the folder's lock) when missing, empty or unloadable."""
    if target.exists() and target.stat().st_size > 0:
        try:
            return KernelLibrary(target)
        except OSError:
            pass  # truncated or corrupt: rebuilt below
    _require_writable(target.parent)
    with exclusive_lock(target.parent / ".lock") as locked:
        if locked:
            _remove_stale(target.parent, target)
        if target.exists() and target.stat().st_size > 0:
            try:
                return KernelLibrary(target)  # another process built it while we waited
            except OSError:
                target.unlink()
        _compile(compiler, source, flags, target, link)
    return KernelLibrary(target)


def build_and_load(source_name: str, flags: tuple[str, ...], compiler: str | None, link: tuple[str, ...] = ()) -> KernelLibrary:
    """Load csrc/<source_name> built with `flags` (+ -fopenmp when the compiler has it), linked with `link`.

    With no compiler (None), a library an earlier build of the same source and flags left in the
    cache is loaded (whichever compiler made it). Raises RuntimeError/OSError with the compiler's
    message when no variant builds or loads.
    """
    source = CSRC / source_name
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # headers key the build too
    if compiler is None:
        return _load_prebuilt(source, hashlib.sha256(text).hexdigest(), flags)
    errors = []
    for variant in (flags + ("-fopenmp",), flags):
        key = hashlib.sha256(text + repr((compiler, variant, link)).encode()).hexdigest()[:16]
        target = cache_dir() / key / f"libqhf_{source.stem}.so"
        try:
            library = _load_or_build(compiler, source, variant, target, link)
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            errors.append(str(err))
            continue
        _record_build(target, hashlib.sha256(text).hexdigest(), variant)
        return library
    raise RuntimeError("\n".join(errors))


BUILD_RECORD = "built_from.json"  # beside each library: the source hash and flags it was built from


def _record_build(target: Path, source_sha: str, variant: tuple[str, ...]) -> None:
    """Note what `target` was built from, so a later process without a compiler can still use it."""
    record = target.parent / BUILD_RECORD
    if record.is_file():
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".json", dir=target.parent)
        with os.fdopen(fd, "w") as handle:
            json.dump({"source_sha256": source_sha, "flags": list(variant), "library": target.name}, handle)
        os.replace(tmp, record)
    except OSError:
        pass  # a read-only cache: the library works, it just cannot be found without a compiler


def _load_prebuilt(source: Path, source_sha: str, flags: tuple[str, ...]) -> KernelLibrary:
    """A cached library of this exact source and flags (with or without -fopenmp), else RuntimeError."""
    wanted = (list(flags) + ["-fopenmp"], list(flags))
    if cache_dir().is_dir():
        for record in sorted(cache_dir().glob(f"*/{BUILD_RECORD}")):
            try:
                data = json.loads(record.read_text())
            except (OSError, ValueError):
                continue
            library = record.parent / f"libqhf_{source.stem}.so"
            if data.get("source_sha256") == source_sha and data.get("flags") in wanted and library.is_file():
                try:
                    return KernelLibrary(library)
                except OSError:
                    continue
    raise RuntimeError(
        f"no C compiler found (install gcc or set $CC) and no build of {source.name} for this version in {cache_dir()}"
    )


def load_checked_entry(
    source_name: str, entry: str, flags: tuple[str, ...], argtypes: list, smoke_test: Callable, what: str
) -> tuple[object | None, str | None]:
    """csrc/<source_name>'s `entry` (returning int) built with `flags` and checked by `smoke_test(fn)`
    (None or why the kernel is wrong): (entry point, None), or (None, why it is unavailable). The entry
    point's `library` is the KernelLibrary it came from (what ops/native.py's C++ ops link to)."""
    try:
        library = build_and_load(source_name, flags, find_compiler())
        fn = getattr(library, entry)
    except (RuntimeError, OSError) as err:
        return None, f"building the {what} failed: {err}"
    fn.library = library
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    mismatch = smoke_test(fn)
    return (None, mismatch) if mismatch else (fn, None)
