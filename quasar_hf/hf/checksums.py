"""SHA-256 of every saved tensor, kept in the safetensors header and checked at load.

safetensors itself has no checksum: bytes flipped on disk or in a partial download load silently
and compute wrong logits. A Quasar save records each tensor's digest (`tensor_digests`, from the
tensors being saved) in the header entry `quasar_sha256`; a load hashes the stored bytes of each
recorded tensor straight from the file (`check_file_digests`, through mmap: no tensor is built)
and refuses a mismatch, naming the tensor and the file. Hashing runs at roughly 1 GB/s on one
core (benchmarks/reports/load-checksum/load_checksum_epyc_avx2.md). Set QUASAR_VERIFY_CHECKSUMS=0 to skip the check.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Iterable

import torch

from quasar_hf.atomic_folder import safetensors_header

DIGESTS_KEY = "quasar_sha256"
SKIP_ENV = "QUASAR_VERIFY_CHECKSUMS"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes safetensors stores for `tensor`: its elements, contiguous, little-endian."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def tensor_digests(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """The header entry: {DIGESTS_KEY: JSON {tensor name: sha256 hex}} of the (name, tensor) pairs being saved
    (`compat.state_dict_values`: offloaded tensors read one at a time)."""
    digests = {name: hashlib.sha256(tensor_bytes(t)).hexdigest() for name, t in tensors if isinstance(t, torch.Tensor)}
    return {DIGESTS_KEY: json.dumps(digests, sort_keys=True)}


def checks_enabled() -> bool:
    return os.environ.get(SKIP_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def check_file_digests(path: str, required: bool = False) -> int:
    """Hash each tensor of the safetensors file at `path` that its header has a digest for; raise on
    the first mismatch. Returns how many tensors were checked (0 for a file without digests).
    `required` (a file quasar_hf saved with digests, as its layout record shows): a header without
    them, or a tensor without one, was edited, and is refused rather than loaded unchecked."""
    name = os.path.basename(path)
    with open(path, "rb") as handle:
        try:
            header, start = safetensors_header(handle)
        except ValueError as error:
            raise ValueError(f"{name} {error}: download or save the checkpoint again") from None
        recorded = (header.get("__metadata__") or {}).get(DIGESTS_KEY)
        if recorded is None:
            if required:
                raise ValueError(
                    f"{name}: its header has no {DIGESTS_KEY} entry, which quasar_hf writes with every layout record, so "
                    f"the header was edited. Download or save the checkpoint again (to load it anyway, set {SKIP_ENV}=0)."
                )
            return 0
        try:
            digests = json.loads(recorded)
        except json.JSONDecodeError:
            raise ValueError(
                f"{os.path.basename(path)}: its {DIGESTS_KEY} header entry is not JSON; the file was modified."
            ) from None
        unrecorded = sorted(key for key in header if key != "__metadata__" and key not in digests) if required else []
        if unrecorded:
            raise ValueError(
                f"{name}: tensor {unrecorded[0]!r} has no SHA-256 in the header's {DIGESTS_KEY} entry, so the header was "
                f"edited. Download or save the checkpoint again (to load it anyway, set {SKIP_ENV}=0)."
            )
        if os.fstat(handle.fileno()).st_size <= start:
            return _check_each(header, digests, memoryview(b""), start, path)
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as data:
            checked = _check_each(header, digests, data, start, path)
    return checked


def _check_each(header: dict, digests: dict, data: memoryview, start: int, path: str) -> int:
    checked = 0
    for name, entry in header.items():
        if name == "__metadata__" or name not in digests:
            continue
        begin, end = entry["data_offsets"]
        if hashlib.sha256(data[start + begin : start + end]).hexdigest() != digests[name]:
            raise ValueError(
                f"{os.path.basename(path)}: the bytes of tensor {name!r} do not match the SHA-256 saved with it, "
                "so the file was corrupted after it was written (a disk error, an interrupted copy or download). "
                f"Download or save the checkpoint again (to load it anyway, set {SKIP_ENV}=0)."
            )
        checked += 1
    return checked
