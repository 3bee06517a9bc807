"""Where quasar_hf's shared caches live (`cache_root`), and a cross-process exclusive lock on a file for
building them (checkpoints, C kernels, compiled steps).

Uses `fcntl.flock` where it exists (Linux, macOS): the kernel drops the lock when the holder
exits, so a crashed build never leaves the cache locked. Elsewhere it degrades to no lock; the
builders stay safe for a single process and publish their results by atomic rename either way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[bool]:
    """Hold an exclusive lock on `path` (created if needed) for the block; yields whether it is a real lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is None:
            yield False
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def cache_root() -> Path:
    """quasar_hf's cache folder: $QUASAR_HF_CACHE, else $XDG_CACHE_HOME/quasar_hf, else ~/.cache/quasar_hf."""
    explicit = os.environ.get("QUASAR_HF_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "quasar_hf"
