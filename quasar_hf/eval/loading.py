"""Load the model pair an accuracy comparison needs: the W8A8 model and its unquantized original."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class ModelPair:
    quantized: Any  # the Quasar W8A8 model
    reference: Any  # the unquantized original
    tokenizer: Any
    quantized_source: str  # what the W8A8 model is (a folder, or "folder quantized now with ...")
    reference_source: str
    quantized_path: str | None  # the saved Quasar checkpoint folder, None when quantized in this run


def resolve(name: str) -> str:
    """An embedded model's alias ('smollm2', ...) -> its folder; a checkpoint folder -> itself; else a Hub id.

    Bad names raise `UsageError` (one line, exit code 2 from the command line), naming the fix."""
    from quasar_hf.commands.loading import resolve_model

    return resolve_model("smollm2" if name == "embedded" else name)


def is_quasar_folder(path: str) -> bool:
    """True when a local checkpoint's config.json says quant_method 'quasar'."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    return (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method") == "quasar"


def add_quantize_arguments(parser: Any) -> None:
    """Options for quantizing an unquantized MODEL in this run (ignored for a Quasar checkpoint)."""
    group = parser.add_argument_group("quantizing an unquantized MODEL now (QuasarConfig)")
    group.add_argument("--alpha", default="auto", help="SmoothQuant alpha in [0, 1] or 'auto' (default)")
    group.add_argument("--num-calibration-samples", type=int, default=32)
    group.add_argument("--calibration-seq-len", type=int, default=512)


def quantize_options(args: Any) -> dict[str, Any]:
    """QuasarConfig keyword arguments from `add_quantize_arguments`' options."""
    alpha = args.alpha if args.alpha == "auto" else float(args.alpha)
    return {
        "alpha": alpha,
        "num_calibration_samples": args.num_calibration_samples,
        "calibration_seq_len": args.calibration_seq_len,
    }


def load_pair(model: str, reference: str | None, dtype: str = "bfloat16", quantize_options: dict | None = None) -> ModelPair:
    """Load both models (eval mode). An unquantized MODEL is quantized now and is its own reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quasar_hf import QuasarConfig  # importing quasar_hf registers quant_method "quasar"
    from quasar_hf.commands.loading import UsageError

    path = resolve(model)  # both checked before anything slow is loaded
    reference_path = resolve(reference) if reference is not None else path
    if is_quasar_folder(path):
        if reference is None:
            raise UsageError(
                f"{model} is a Quasar checkpoint; pass its unquantized original with --reference (a folder, Hub id or 'smollm2')"
            )
    if reference is not None and is_quasar_folder(reference_path):
        raise UsageError(f"--reference {reference} is a Quasar checkpoint; pass the unquantized original")
    torch_dtype = getattr(torch, dtype)
    if is_quasar_folder(path):
        quantized = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
        quantized_source, quantized_path = path, path
    else:
        options = dict(quantize_options or {})
        quantized = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=QuasarConfig(**options), dtype=torch_dtype
        ).eval()
        quantized_source, quantized_path = f"{path} quantized in this run with QuasarConfig({options or ''})", None
    reference_model = AutoModelForCausalLM.from_pretrained(reference_path, dtype=torch_dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return ModelPair(quantized, reference_model, tokenizer, quantized_source, reference_path, quantized_path)
