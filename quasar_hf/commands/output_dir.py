"""Checks on an `--out` folder, run before any work so nothing a user saved is overwritten.

Rules (same for `quantize` and `export`):
  * the output folder may never be the input folder (symlinks resolved, and inodes compared, so a
    bind mount of the input counts too) or lie inside it;
  * a missing or empty folder is fine, and so is a folder holding a checkpoint of the kind the
    command writes (a previous result, replaced);
  * any other non-empty folder is refused unless `--overwrite` is given;
  * the path must not be a file, and the folder (or the nearest existing parent it would be
    created in) must be writable: checked by creating and removing a probe file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from quasar_hf.commands.loading import UsageError

KIND_NAMES = {"quasar": "Quasar W8A8", "compressed-tensors": "compressed-tensors"}


def checkpoint_kind(folder: Path) -> str | None:
    """The quant_method in `folder/config.json` ('quasar', 'compressed-tensors', ...), 'plain' or None."""
    config = folder / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    qconfig = data.get("quantization_config") or {}
    return qconfig.get("quant_method", "plain") if isinstance(qconfig, dict) else "plain"


def check_output_dir(out: str, source: str | None, kind: str, overwrite: bool = False) -> Path:
    """Refuse an `--out` that would overwrite the input or unrelated files; return the resolved folder.

    `source` is the input checkpoint (a local folder, or a Hub id, which has no local folder);
    `kind` is the quant_method of what the command writes ('quasar' or 'compressed-tensors').
    """
    target = Path(os.path.expanduser(out)).resolve()
    if source is not None and Path(os.path.expanduser(source)).is_dir():
        origin = Path(os.path.expanduser(source)).resolve()
        if target == origin or _same_folder(target, origin):  # paths, then inodes (a bind mount of the input)
            raise UsageError(f"--out {out} is the input folder; writing there would replace the input. Choose another folder")
        if origin in target.parents or any(_same_folder(parent, origin) for parent in target.parents):
            raise UsageError(f"--out {out} lies inside the input folder {source}; choose a folder outside it")
    if target.exists() and not target.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder; choose a folder path")
    if target.is_dir() and any(target.iterdir()) and checkpoint_kind(target) != kind and not overwrite:
        raise UsageError(
            f"--out {out} is a non-empty folder that is not a {KIND_NAMES.get(kind, kind)} checkpoint; "
            "choose a new or empty folder, or pass --overwrite to write into it anyway"
        )
    _check_writable(target, out)
    return target


def _same_folder(a: Path, b: Path) -> bool:
    """True when both exist and are one folder (same device and inode), whatever their paths."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _check_writable(target: Path, out: str) -> None:
    """Create and remove a probe file in `target` or, when it does not exist yet, its nearest existing parent."""
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"--out {out} cannot be created: {existing} is a file")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise UsageError(f"--out {out} is not writable ({error.strerror} in {existing}); choose a writable folder") from None
