"""Model loading and resolution shared by the CLI subcommands (heavy imports stay inside functions)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

DTYPES = ("bfloat16", "float16", "float32")


class UsageError(Exception):
    """A user error in the command line (exit code 2): the message names the problem and the fix."""


def resolve_model(name: str) -> str:
    """A local checkpoint folder, a Hub repo id, or an embedded model's alias ('smollm2', 'gemma3', 'qwen2.5-coder')."""
    from quasar_hf.models import EMBEDDED_ALIASES, build_embedded

    if name in EMBEDDED_ALIASES:
        return build_embedded(EMBEDDED_ALIASES[name])
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{name} is a folder without config.json; pass a Transformers checkpoint folder")
        return str(path)
    if path.exists():
        raise UsageError(f"{name} is a file; pass a checkpoint folder (with config.json), a Hub repo id or 'smollm2'")
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise UsageError(
            f"model folder {name} does not exist; pass a local checkpoint folder, a Hub repo id (owner/name) "
            f"or 'smollm2' for the embedded SmolLM2-135M-Instruct"
        )
    return name  # a Hub repo id: from_pretrained downloads it (needs network)


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def load_tokenizer(path: str) -> Any:
    """The checkpoint's tokenizer, or a one-line usage error saying how to provide one."""
    import os

    from transformers import AutoTokenizer

    if os.path.isdir(path) and not any(
        os.path.exists(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        raise UsageError(
            f"{path} has no tokenizer files; save one next to the model (tokenizer.save_pretrained({path!r})), "
            "or quantize with `quasar-hf quantize`, which saves it"
        )
    return AutoTokenizer.from_pretrained(path)


def load_model(path: str, dtype: str | None = None, **kwargs: Any) -> Any:
    """from_pretrained with quasar_hf registered (Quasar checkpoints load as W8A8), in eval mode."""
    from transformers import AutoModelForCausalLM

    import quasar_hf  # noqa: F401  (registers quant_method "quasar")

    if dtype is not None:
        kwargs["dtype"] = torch_dtype(dtype)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def is_quasar_checkpoint(path: str) -> bool:
    """True when a local checkpoint's config.json says quant_method 'quasar'."""
    import json

    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    qconfig = json.loads(config.read_text()).get("quantization_config") or {}
    return qconfig.get("quant_method") == "quasar"


def encode_prompt(tokenizer: Any, prompt: str, use_chat_template: bool = True) -> Any:
    """Token ids [1, T]; the chat template is applied when the tokenizer has one."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        return encoded["input_ids"]
    return tokenizer(prompt, return_tensors="pt").input_ids


def quantize_checkpoint(path: str, options: dict, dtype: str) -> Any:
    """Load `path` and quantize it with QuasarConfig(**options)."""
    from quasar_hf import QuasarConfig

    try:
        config = QuasarConfig(**options)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return load_model(path, dtype=dtype, quantization_config=config)


def save_quantized(model: Any, tokenizer: Any, out_dir: str, base_model: str | None = None) -> None:
    """save_pretrained + tokenizer + our model card (rendered with the tokenizer's chat template)."""
    from quasar_hf.atomic_folder import atomic_folder
    from quasar_hf.hf.binding import save_quasar_files
    from quasar_hf.hub.model_card import model_card_for, write_model_card

    with atomic_folder(out_dir) as staging:  # model, tokenizer and card replace the folder in one step
        save_quasar_files(model, staging)  # writes a first card (and warns about a user README)
        tokenizer.save_pretrained(staging)
        with warnings.catch_warnings():  # same README decision as the first card's, already reported
            warnings.simplefilter("ignore")
            write_model_card(staging, model_card_for(model, base_model=base_model, tokenizer=tokenizer))
