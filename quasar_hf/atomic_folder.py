"""Replace a checkpoint folder all at once, so a failed or killed save never leaves a mix.

    with atomic_folder("smollm2-quasar") as staging:   # a new folder beside the target
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    # the target now holds the new files, plus the old folder's files that the new save does not
    # replace (a user's notes, a tokenizer saved earlier); stale weight files of any layout are gone

How: everything is written into `.<name>.quasar-staging-<pid>-*` beside the target. On success
the staging folder is checked (config.json parses, every safetensors file is as long as its header
says, every shard an index names exists), the old folder's other files are hard-linked in (copied
where links are impossible), and the two folders are swapped in one `renameat2(RENAME_EXCHANGE)`
(two renames where that call is missing). The old contents are then removed. On any error, or
KeyboardInterrupt, the staging folder is removed and the target is untouched. A process killed
outright leaves its staging folder behind: the next save to the same target removes it.

Not atomic, and said so with a warning: a target that is a mount point (nothing can be renamed
onto it) or the current working directory (renaming it would move the process's cwd); there the
new files are moved in one by one, config.json last.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

STAGING_TAG = ".quasar-staging-"
# Files a model save replaces as a whole: never carried over from the old folder, so a sharded
# save over an unsharded one (or the reverse) leaves no stale weights beside the new ones. Other
# weight-like files (training_args.bin, adapter_model.safetensors) are the user's and are kept.
REPLACED = re.compile(
    r"(config|generation_config)\.json"
    r"|(model|pytorch_model|tf_model|flax_model)(-\d+-of-\d+)?\.(safetensors|bin|h5|msgpack)"
    r"|(model\.safetensors|pytorch_model\.bin)\.index\.json"
)
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


class CheckpointWriteError(RuntimeError):
    """The files written into the staging folder are incomplete; the target folder was not changed."""


@contextmanager
def atomic_folder(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging folder; on a clean exit its files replace `target`'s (see the module doc)."""
    final = Path(os.path.expanduser(os.fspath(target))).absolute()
    if final.exists() and not final.is_dir():
        raise NotADirectoryError(f"{target} is a file, not a folder; choose a folder path to save into")
    final = final.resolve() if final.exists() else final
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_staging(final)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}{STAGING_TAG}{os.getpid()}-", dir=final.parent))
    try:
        _match_mode(staging, final)
        readme = final / "README.md"
        if readme.is_file():  # the model card decides by the README already there
            shutil.copy2(readme, staging / "README.md")
        yield staging
        verify_checkpoint_files(staging)
        if _in_place_only(final):
            _move_in_place(staging, final)
        else:
            _carry_over(final, staging)
            _swap_in(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write one text file (UTF-8) atomically: `write_bytes_atomically`."""
    write_bytes_atomically(path, text.encode("utf-8"))


def write_bytes_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Write one file via a temporary file in the same folder (flushed to disk) and `os.replace`: a reader
    sees the old file or the new one, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def verify_checkpoint_files(folder: Path) -> None:
    """Raise CheckpointWriteError unless every config parses and every weight file is complete."""
    for config in folder.glob("*.json"):
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise CheckpointWriteError(f"{config.name} was not written completely ({error}); the old folder is kept") from None
    for weights in folder.glob("*.safetensors"):
        problem = safetensors_problem(weights)
        if problem:
            raise CheckpointWriteError(f"{weights.name} {problem}; the old folder is kept")
    for index in folder.glob("*.index.json"):
        shards = set((json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}).values())
        missing = sorted(name for name in shards if not (folder / name).is_file())
        if missing:
            raise CheckpointWriteError(f"{index.name} names shards that were not written: {missing}; the old folder is kept")


def safetensors_header(source: BinaryIO | bytes) -> tuple[dict, int]:
    """The JSON header of a safetensors file (an open binary file at its start, or the file's bytes) and the
    offset where its tensor data starts (8 + the header's length). ValueError naming what is wrong."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        size, prefix = len(source), bytes(source[:8])
    else:
        size, prefix = os.fstat(source.fileno()).st_size, source.read(8)
    header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if header_len < 0 or header_len > size - 8:
        raise ValueError(f"is truncated ({size} bytes, header claims {max(header_len, 0)})")
    raw = source[8 : 8 + header_len] if isinstance(source, (bytes, bytearray, memoryview)) else source.read(header_len)
    try:
        return json.loads(bytes(raw)), 8 + header_len
    except ValueError as error:
        raise ValueError(f"has an unreadable header ({error})") from None


def safetensors_problem(path: Path) -> str | None:
    """None when the file's size matches its header (8-byte length, JSON, tensor bytes), else what is wrong."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            header, start = safetensors_header(handle)
    except OSError as error:
        return f"has an unreadable header ({error})"
    except ValueError as error:
        return str(error)
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    expected = start + max(ends, default=0)
    return None if size == expected else f"is {size} bytes, its header says {expected}"


def remove_dead_staging(final: Path) -> None:
    """Remove staging folders that saves to `final` by processes no longer running left behind."""
    for stray in final.parent.glob(f".{glob.escape(final.name)}{STAGING_TAG}*"):
        pid = stray.name[len(final.name) + 1 + len(STAGING_TAG) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stray, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _match_mode(staging: Path, final: Path) -> None:
    """The staging folder gets the old folder's permissions (a new one: the umask's), not mkdtemp's 0700."""
    os.chmod(staging, (final.stat().st_mode & 0o7777) if final.is_dir() else (0o777 & ~_umask()))


def _in_place_only(final: Path) -> bool:
    """True when `final` cannot be swapped: a mount point, or the cwd (or a folder holding it)."""
    if not final.exists():
        return False
    cwd = Path.cwd().resolve()
    return os.path.ismount(final) or cwd == final or final in cwd.parents


def _is_replaced(name: str) -> bool:
    return REPLACED.fullmatch(name) is not None


def _carry_over(final: Path, staging: Path) -> None:
    """Link the old folder's files that the new save neither wrote nor replaces into `staging`."""
    if not final.is_dir():
        return
    for entry in final.iterdir():
        destination = staging / entry.name
        if destination.exists() or destination.is_symlink() or _is_replaced(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, destination, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(destination))


def _link_or_copy(source: str, destination: str) -> None:
    """A hard link (no bytes copied; nothing writes these files again), else a copy."""
    if os.path.islink(source):
        os.symlink(os.readlink(source), destination)
        return
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _swap_in(staging: Path, final: Path) -> None:
    """Make `staging`'s contents `final`'s; afterwards `staging` holds the old contents (or nothing)."""
    if not final.exists():
        os.rename(staging, final)
        staging.mkdir()  # so the caller's cleanup has a folder to remove
        return
    if _exchange(staging, final):
        return
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}{STAGING_TAG}{os.getpid()}-old-", dir=final.parent))
    old.rmdir()
    os.rename(final, old)
    try:
        os.rename(staging, final)
    except OSError:
        os.rename(old, final)
        raise
    os.rename(old, staging)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically with Linux's renameat2(RENAME_EXCHANGE); False where unsupported."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    return False  # ENOSYS / EINVAL (filesystem without exchange): the two-rename fallback runs


def _move_in_place(staging: Path, final: Path) -> None:
    """Move the new files into `final` one by one (each `os.replace` is atomic, config.json last)."""
    warnings.warn(
        f"{final} is a mount point or the working directory, so it cannot be replaced in one step; "
        "the new files were moved in one by one (a crash midway could leave a mix). Save into a subfolder to avoid this.",
        UserWarning,
        stacklevel=4,
    )
    for stale in final.iterdir():
        if _is_replaced(stale.name) and not (staging / stale.name).exists() and stale.is_file():
            stale.unlink()
    entries = sorted(staging.iterdir(), key=lambda entry: entry.name == "config.json")
    for entry in entries:
        destination = final / entry.name
        if destination.is_dir() and not destination.is_symlink() and entry.is_dir():
            shutil.rmtree(destination)
        os.replace(entry, destination)
