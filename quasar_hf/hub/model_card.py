"""Model cards for Quasar W8A8 checkpoints, rendered from `model_cards/template.md`.

The card's YAML front matter is built with `huggingface_hub.ModelCardData` (library_name,
base_model, tags, pipeline_tag) and checked with `huggingface_hub.ModelCard` after rendering.
The body states the Quasar configuration and, only when they were measured (the
`measured` dict recorded on the QuasarConfig), the fidelity and speed numbers plus the command
that produced them. Our cards carry `CARD_MARKER`, so a README written by someone else is
recognised and never overwritten silently (see `write_model_card`).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from quasar_hf.atomic_folder import write_text_atomically

CARD_MARKER = "<!-- quasar-hf:model-card"
README_NAME = "README.md"
FALLBACK_CARD_NAME = "QUASAR_MODEL_CARD.md"
CARD_TAGS = ("quasar", "w8a8", "int8", "smoothquant", "speculative-decoding")
REQUIRED_TAGS = ("quasar", "w8a8", "smoothquant", "speculative-decoding")

# measured-dict key -> label; anything else measured lands in "Other measurements".
FIDELITY_LABELS = {
    "perplexity": "Perplexity (W8A8)",
    "reference_perplexity": "Perplexity (unquantized reference)",
    "perplexity_ratio": "Perplexity ratio (W8A8 / reference)",
    "perplexity_ratio_interval": "Perplexity ratio, 95 % interval (bootstrap over evaluation blocks)",
    "top1_agreement": "Top-1 agreement with the reference",
    "kl_divergence": "Mean KL divergence of W8A8 from the reference per token (nats)",
    "num_tokens": "Evaluated tokens",
    "fidelity_dataset": "Evaluation text",
}
SPEED_LABELS = {
    "mean_acceptance_length": "Mean acceptance length L (W8A8 verifier)",
    "mean_acceptance_length_bf16": "Mean acceptance length L (BF16 verifier)",
    "tokens_per_s": "Tokens/s (W8A8 verifier)",
    "tokens_per_s_bf16_verify": "Tokens/s (BF16 verifier)",
    "tokens_per_s_plain": "Tokens/s (plain greedy decoding)",
    "speedup_vs_bf16_verify": "Speedup vs the same speculation with BF16 verification",
    "speedup_vs_plain": "Speedup vs plain decoding",
    "drafter": "Drafter",
    "device": "Device",
    "speed_suite": "Prompt suite",
}
ACCURACY_KEY = "accuracy"  # measured["accuracy"]: rows written by quasar_hf.eval.accuracy.record_accuracy
# folder-name prefixes of the checkpoints quasar_hf.models builds offline -> their Hub ids
KNOWN_BASE_MODELS = {
    "SmolLM2-135M-Instruct": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "Qwen2.5-Coder-0.5B-Instruct": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    "gemma-3-270m": "google/gemma-3-270m",
}


def template_path() -> Path:
    """Where the card template lives: packaged data first, then the source tree's model_cards/."""
    package_root = Path(__file__).resolve().parents[1]
    candidates = [package_root / "data" / "model_card_template.md", package_root.parent / "model_cards" / "template.md"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"quasar_hf's model card template is missing; looked in {[str(c) for c in candidates]}")


def quantization_dict(source: Any) -> dict:
    """A QuasarConfig, a dict, or a model holding one -> plain dict (empty when there is none)."""
    config = getattr(source, "config", None)
    if config is not None and hasattr(config, "quantization_config"):
        source = config.quantization_config
    if source is None:
        return {}
    if isinstance(source, dict):
        return dict(source)
    if hasattr(source, "to_dict"):
        return source.to_dict()
    raise TypeError(f"expected a QuasarConfig, a dict or a model, got {type(source).__name__}")


def guess_base_model(model: Any) -> str | None:
    """The Hub repo id the model came from, when its name says so (local paths give None)."""
    from quasar_hf import compat

    return base_model_from_name(compat.name_or_path(model))


def base_model_from_name(name: str) -> str | None:
    """'owner/name' -> itself; known embedded checkpoints -> their Hub id; local paths -> None."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    for known, repo_id in KNOWN_BASE_MODELS.items():
        if Path(name).name.startswith(known):
            return repo_id
    if not name or os.path.exists(name) or name.count("/") != 1:
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _rows(measured: dict, labels: dict[str, str]) -> list[tuple[str, str]]:
    return [(label, _format(measured[key])) for key, label in labels.items() if measured.get(key) is not None]


def _other_rows(measured: dict) -> list[tuple[str, str]]:
    known = set(FIDELITY_LABELS) | set(SPEED_LABELS) | {"command", ACCURACY_KEY}
    return [(f"`{key}`", _format(value)) for key, value in measured.items() if key not in known and value is not None]


def _accuracy_rows(measured: dict) -> list[tuple[str, ...]]:
    """(task, metric, unquantized, W8A8, recovery, harness) cells of the measured task accuracy."""
    rows = []
    for row in measured.get(ACCURACY_KEY) or []:
        recovery = row.get("recovery_pct")
        recovery_text = f"{recovery:.1f} %" if recovery is not None else "-"
        scores = [_format(row.get(key)) if row.get(key) is not None else "-" for key in ("reference", "quantized")]
        rows.append((row.get("task"), row.get("metric"), *scores, recovery_text, row.get("harness", "")))
    return rows


def _natural_key(name: str) -> list:
    """'10.mlp' sorts after '2.mlp': digit runs compare as numbers."""
    import re

    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _rounding_text(rounding: str) -> str:
    if rounding == "gptq":
        return "GPTQ rounding on the calibration inputs (second-order, Frantar et al. 2022)"
    return "rounded to nearest"


def _calibration_text(qconfig: dict) -> str:
    info = qconfig.get("calibration_info") or {}
    source = info.get("source", qconfig.get("calibration_dataset")) or "built-in offline text"
    samples = info.get("num_samples", qconfig.get("num_calibration_samples"))
    seq_len = info.get("seq_len", qconfig.get("calibration_seq_len"))
    details = [f"{samples} samples" if samples is not None else None, f"{seq_len} tokens each" if seq_len else None]
    details = [d for d in details if d]
    return f"{source}" + (f" ({', '.join(details)})" if details else "")


def _rotation_text(qconfig: dict) -> str:
    rotated = qconfig.get("rotated_modules") or []
    if not rotated:
        return "none"
    kinds = sorted({name.rsplit(".", 1)[-1] for name in rotated})
    return f"{', '.join(f'`{k}`' for k in kinds)} ({len(rotated)} linears; online, W8A8 verify path only)"


def _draft_path_text(qconfig: dict) -> str:
    layers = qconfig.get("draft_layers")
    if layers is None:
        return "external drafter (n-gram prompt lookup by default); the full W8A8 model verifies"
    return f"self-drafting with layers {layers} ({qconfig.get('draft_dtype') or 'model dtype'})"


def card_metadata(base_model: str | None, extra_tags: tuple[str, ...] = (), pipeline_tag: str = "text-generation"):
    """The YAML front matter as `huggingface_hub.ModelCardData`."""
    from huggingface_hub import ModelCardData

    tags = list(dict.fromkeys([*CARD_TAGS, *extra_tags]))
    data = ModelCardData(library_name="transformers", pipeline_tag=pipeline_tag, tags=tags, license=None)
    if base_model:
        data.base_model = base_model
        data.base_model_relation = "quantized"
    return data


def render_model_card(
    qconfig: dict,
    *,
    repo_id: str,
    base_model: str | None = None,
    title: str | None = None,
    has_chat_template: bool = False,
    extra_tags: tuple[str, ...] = (),
) -> str:
    """Render the card text for a Quasar checkpoint described by `qconfig` (QuasarConfig.to_dict())."""
    from huggingface_hub import ModelCard

    if str(qconfig.get("quant_method")) != "quasar":
        raise ValueError(
            f"render_model_card needs a Quasar quantization config, got quant_method={qconfig.get('quant_method')!r}"
        )
    measured = dict(qconfig.get("measured") or {})
    searched = qconfig.get("searched_alphas") or {}
    card = ModelCard.from_template(
        card_metadata(base_model, extra_tags),
        template_path=str(template_path()),
        title=title or f"{(base_model or repo_id).split('/')[-1]} - Quasar W8A8",
        base_model=base_model,
        repo_id=repo_id,
        has_chat_template=has_chat_template,
        bits=qconfig.get("bits", 8),
        rounding=_rounding_text(qconfig.get("weight_rounding", "nearest")),
        alpha=_format(qconfig.get("alpha")) + (" (searched per layer)" if searched else ""),
        searched_alphas=[(layer, _format(searched[layer])) for layer in sorted(searched, key=_natural_key)],
        calibration=_calibration_text(qconfig),
        rotation=_rotation_text(qconfig),
        excluded=", ".join(f"`{m}`" for m in (qconfig.get("modules_to_not_convert") or ["lm_head"])),
        draft_path=_draft_path_text(qconfig),
        backend=qconfig.get("backend", "auto"),
        version=qconfig.get("version", "unknown"),
        fidelity=_rows(measured, FIDELITY_LABELS),
        speed=_rows(measured, SPEED_LABELS),
        other_measured=_other_rows(measured),
        accuracy=_accuracy_rows(measured),
        accuracy_commands=list(dict.fromkeys(r["command"] for r in measured.get(ACCURACY_KEY) or [] if r.get("command"))),
        command=measured.get("command"),
    )
    text = str(card)
    validate_model_card(text)
    return text


def validate_model_card(text: str):
    """Parse `text` with huggingface_hub.ModelCard and check the metadata a Quasar card must carry."""
    from huggingface_hub import ModelCard
    from huggingface_hub.utils import validate_repo_id

    card = ModelCard(text)
    data = card.data.to_dict()
    if data.get("library_name") != "transformers":
        raise ValueError(f"model card library_name must be 'transformers', got {data.get('library_name')!r}")
    missing = [tag for tag in REQUIRED_TAGS if tag not in (data.get("tags") or [])]
    if missing:
        raise ValueError(f"model card is missing the tags {missing}")
    if data.get("base_model") is not None:
        validate_repo_id(data["base_model"])
    return card


def is_quasar_card(text: str) -> bool:
    """True when the text is a card quasar_hf wrote (it carries CARD_MARKER)."""
    return CARD_MARKER in text


def model_card_for(model: Any, repo_id: str | None = None, base_model: str | None = None, tokenizer: Any = None) -> str:
    """Render the card for a loaded Quasar model (config read from `model.config.quantization_config`)."""
    qconfig = quantization_dict(model)
    base_model = base_model or guess_base_model(model)
    repo_id = repo_id or (f"your-name/{base_model.split('/')[-1]}-quasar-w8a8" if base_model else "path/to/this/folder")
    has_chat_template = (
        bool(getattr(tokenizer, "chat_template", None))
        if tokenizer is not None
        else bool(base_model and "Instruct" in base_model)
    )
    return render_model_card(qconfig, repo_id=repo_id, base_model=base_model, has_chat_template=has_chat_template)


def write_model_card(directory: str | os.PathLike, text: str) -> Path:
    """Write `text` as README.md, unless a README we did not write is there: then keep it, write
    QUASAR_MODEL_CARD.md beside it and warn (a user's README is never overwritten silently)."""
    folder = Path(directory)
    readme = folder / README_NAME
    if readme.exists() and not is_quasar_card(readme.read_text(encoding="utf-8", errors="replace")):
        target = folder / FALLBACK_CARD_NAME
        warnings.warn(
            f"{readme} exists and was not written by quasar_hf; kept it and wrote the Quasar model card to "
            f"{target.name} instead (delete or rename your README.md to get the card as README.md)",
            UserWarning,
            stacklevel=3,
        )
    else:
        target = readme
    write_text_atomically(target, text)
    return target


def record_measurements(folder: str | os.PathLike, measured: dict, base_model: str | None = None) -> Path:
    """Merge `measured` into a saved Quasar checkpoint's quantization_config.measured and refresh its card."""
    import json

    config_path = Path(folder) / "config.json"
    config = json.loads(config_path.read_text())
    qconfig = config.get("quantization_config") or {}
    if qconfig.get("quant_method") != "quasar":
        raise ValueError(f"{folder} is not a Quasar checkpoint (quant_method={qconfig.get('quant_method')!r})")
    qconfig["measured"] = {**(qconfig.get("measured") or {}), **measured}
    config["quantization_config"] = qconfig
    write_text_atomically(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    has_chat_template = (Path(folder) / "chat_template.jinja").exists() or '"chat_template"' in _read(
        Path(folder) / "tokenizer_config.json"
    )
    base_model = base_model or base_model_from_name(str(config.get("_name_or_path", "")))
    text = render_model_card(qconfig, repo_id=str(folder), base_model=base_model, has_chat_template=has_chat_template)
    return write_model_card(folder, text)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
