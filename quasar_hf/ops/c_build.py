"""Build a shared library from `ops/csrc/` at first use (the C++ library of the quasar:: ops' CPU kernels).

A library is a list of compile units (a source and its own flags: each ISA build of a C kernel is
one unit) linked into one file. It goes to a per-user cache (`$QUASAR_HF_KERNEL_CACHE`, else
`$XDG_CACHE_HOME/quasar_hf/kernels`, else `~/.cache/quasar_hf/kernels`), keyed by a hash of every
source and header + compiler + flags, so editing a source or upgrading the package rebuilds. Builds
hold an exclusive file lock per key folder and publish the library by atomic rename, so concurrent
processes never see a half-written file; under the lock, temporary files left by a crashed compile
and empty libraries are removed and rebuilt. Loading is the caller's (`torch.ops.load_library`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from quasar_hf.locking import exclusive_lock

CSRC = Path(__file__).parent / "csrc"
# Never -ffast-math; -ffp-contract=off forbids FMA contraction (both would change rounding).
PORTABLE_CFLAGS = ("-O3", "-fPIC", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math")
TEMP_PREFIX = "tmp"  # builds write <folder>/tmp*, then rename the library into place
SOURCE_SUFFIXES = (".c", ".cpp", ".h", ".def")  # what keys a build (every file of csrc/ with these)


MASK_ENV = "QUASAR_HF_CPU_FLAGS_OFF"  # e.g. "avx512f,avx512_vnni": build and run as on a CPU without them


def masked_cpu_flags() -> set[str]:
    """CPU flags that `$QUASAR_HF_CPU_FLAGS_OFF` (comma-separated /proc/cpuinfo names) says to treat as absent.

    Lets one machine run the kernels' tests as a CPU with fewer features would: the C++ library reads
    the same variable when it picks each kernel's build."""
    return {flag.strip() for flag in os.environ.get(MASK_ENV, "").split(",") if flag.strip()}


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def missing_cpu_flags(required: tuple[str, ...]) -> list[str]:
    """CPU flags in `required` that /proc/cpuinfo does not list, or that are masked (all of them off
    x86-64 or if /proc/cpuinfo is unreadable)."""
    if not required:
        return []
    if not is_x86_64():
        return list(required)
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return list(required)
    flags_line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    flags = set(flags_line.split(":", 1)[-1].split()) - masked_cpu_flags()
    return [f for f in required if f not in flags]


def cache_dir() -> Path:
    """Where built libraries live (created on demand)."""
    root = os.environ.get("QUASAR_HF_KERNEL_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "quasar_hf" / "kernels"


def find_compiler() -> str | None:
    """$CXX, else g++, else c++ on PATH (it compiles the C kernels too, as C)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@dataclass(frozen=True)
class CompileUnit:
    """One object of a library: csrc/<source> compiled with `flags` (C sources as C, C++ as C++)."""

    source: str
    flags: tuple[str, ...]

    def command(self, compiler: str, folder: Path, output: Path) -> list[str]:
        language = ("-x", "c") if self.source.endswith(".c") else ("-x", "c++")
        return [compiler, *language, *self.flags, f"-I{folder}", "-c", "-o", str(output), str(folder / self.source)]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{done.stderr.strip()[-2000:]}")


def _compile(compiler: str, units: list[CompileUnit], link: tuple[str, ...], target: Path) -> None:
    """Compile every unit (in parallel) and link them into `target` atomically (temp files + rename)."""
    work = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=target.parent))
    try:
        objects = [work / f"{i}_{Path(u.source).stem}.o" for i, u in enumerate(units)]
        commands = [u.command(compiler, CSRC, o) for u, o in zip(units, objects)]
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            list(pool.map(_run, commands))  # re-raises the first failure
        library = work / target.name
        _run([compiler, "-shared", "-o", str(library), *map(str, objects), *link, "-lm"])
        if os.path.getsize(library) == 0:
            raise RuntimeError(f"linking {target.name} wrote an empty library")
        os.replace(library, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _remove_stale(folder: Path, target: Path) -> None:
    """Temporary files of crashed builds, and `target` if it is empty (only called under the lock)."""
    for stray in folder.glob(f"{TEMP_PREFIX}*"):
        shutil.rmtree(stray, ignore_errors=True) if stray.is_dir() else stray.unlink(missing_ok=True)
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


def _build_once(compiler: str, units: list[CompileUnit], link: tuple[str, ...], target: Path) -> Path:
    """`target`, built first (under the folder's lock) when missing or empty."""
    if target.exists() and target.stat().st_size > 0:
        return target
    _require_writable(target.parent)
    with exclusive_lock(target.parent / ".lock") as locked:
        if locked:
            _remove_stale(target.parent, target)
        if not (target.exists() and target.stat().st_size > 0):  # else another process built it while we waited
            _compile(compiler, units, link, target)
    return target


def sources_digest(units: list[CompileUnit]) -> str:
    """A hash of every source and header in csrc/ and of any unit's source outside it (what a build is made from)."""
    paths = sorted(p for p in CSRC.iterdir() if p.suffix in SOURCE_SUFFIXES)
    paths += [CSRC / u.source for u in units if (CSRC / u.source).parent != CSRC]  # an absolute path: a file elsewhere
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.name).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build_library(name: str, units: list[CompileUnit], link: tuple[str, ...], compiler: str | None) -> Path:
    """The path of lib<name>.so built from `units` (+ -fopenmp when the compiler has it), linked with `link`.

    With no compiler (None), a library an earlier build of the same sources and units left in the
    cache is returned (whichever compiler made it). Raises RuntimeError/OSError with the compiler's
    message when no variant builds.
    """
    source_sha = sources_digest(units)
    recipe = [[u.source, list(u.flags)] for u in units]
    if compiler is None:
        return _prebuilt(name, source_sha, recipe)
    errors = []
    for openmp in (("-fopenmp",), ()):
        variant = [CompileUnit(u.source, (*u.flags, *openmp)) for u in units]
        key = hashlib.sha256(f"{source_sha}{compiler}{recipe}{openmp}{link}".encode()).hexdigest()[:16]
        target = cache_dir() / key / f"lib{name}.so"
        try:
            path = _build_once(compiler, variant, (*link, *openmp), target)
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            errors.append(str(err))
            continue
        _record_build(target, source_sha, recipe)
        return path
    raise RuntimeError("\n".join(errors))


BUILD_RECORD = "built_from.json"  # beside each library: the source hash and units it was built from


def _record_build(target: Path, source_sha: str, recipe: list) -> None:
    """Note what `target` was built from, so a later process without a compiler can still use it."""
    record = target.parent / BUILD_RECORD
    if record.is_file():
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".json", dir=target.parent)
        with os.fdopen(fd, "w") as handle:
            json.dump({"source_sha256": source_sha, "units": recipe, "library": target.name}, handle)
        os.replace(tmp, record)
    except OSError:
        pass  # a read-only cache: the library works, it just cannot be found without a compiler


def _prebuilt(name: str, source_sha: str, recipe: list) -> Path:
    """A cached library of these exact sources and units, else RuntimeError."""
    if cache_dir().is_dir():
        for record in sorted(cache_dir().glob(f"*/{BUILD_RECORD}")):
            try:
                data = json.loads(record.read_text())
            except (OSError, ValueError):
                continue
            library = record.parent / f"lib{name}.so"
            if data.get("source_sha256") == source_sha and data.get("units") == recipe and library.is_file():
                return library
    raise RuntimeError(
        f"no C++ compiler found (install g++ or set $CXX) and no build of lib{name} for this version in {cache_dir()}"
    )
