"""Build a C kernel from `ops/csrc/` at first use and load it with ctypes (shared by the CPU kernels).

Libraries go to a per-user cache (`$QUASAR_HF_KERNEL_CACHE`, else `$XDG_CACHE_HOME/quasar_hf/kernels`,
else `~/.cache/quasar_hf/kernels`), keyed by a hash of source + compiler + flags, so editing a
source or upgrading the package rebuilds, and concurrent processes never see a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
# Never -ffast-math; -ffp-contract=off forbids FMA contraction (both would change rounding).
PORTABLE_CFLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off", "-fno-fast-math")


def missing_cpu_flags(required: tuple[str, ...]) -> list[str]:
    """CPU flags in `required` that /proc/cpuinfo does not list (all of them off x86-64 or if unreadable)."""
    if not required:
        return []
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return list(required)
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return list(required)
    flags_line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    flags = set(flags_line.split(":", 1)[-1].split())
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


def _compile(compiler: str, source: Path, flags: tuple[str, ...], target: Path) -> None:
    """Compile `source` into `target` atomically (temp file + rename; safe across processes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, "-o", tmp, str(source), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_and_load(source_name: str, flags: tuple[str, ...], compiler: str) -> ctypes.CDLL:
    """Load csrc/<source_name> built with `flags` (+ -fopenmp when the compiler has it).

    Raises RuntimeError/OSError with the compiler's message when no variant builds.
    """
    source = CSRC / source_name
    text = source.read_bytes()
    errors = []
    for variant in (flags + ("-fopenmp",), flags):
        key = hashlib.sha256(text + repr((compiler, variant)).encode()).hexdigest()[:16]
        target = cache_dir() / key / f"libqhf_{source.stem}.so"
        try:
            if not target.exists():
                _compile(compiler, source, variant, target)
            return ctypes.CDLL(str(target))
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            errors.append(str(err))
    raise RuntimeError("\n".join(errors))
