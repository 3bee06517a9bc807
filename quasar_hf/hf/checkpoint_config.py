"""A saved Quasar checkpoint that Transformers without quasar_hf refuses instead of misreading.

Transformers skips a `quantization_config` whose quant_method it does not know (with a warning) and
loads the int8 weights into float `nn.Linear`s: the model runs and its logits are garbage. So a
Quasar save marks its config.json (`mark_checkpoint`):
  * `model_type` is "quasar_hf"; the model's own type moves to `quasar_base_model_type`;
  * `auto_map` names `quasar_hf_config.QuasarCheckpointConfig`, a file written beside it that
    imports this module, or fails naming quasar_hf and its install command.
Without quasar_hf, `AutoConfig` (behind `AutoModelForCausalLM`, `pipeline`) finds an unknown model
type with custom code and refuses unless `trust_remote_code=True`; with it, the file says to
install quasar_hf, or, where quasar_hf is installed, imports it and the checkpoint loads as it does
after `import quasar_hf`. There, `register_checkpoint_config` has registered "quasar_hf" with
`AutoConfig`, and `QuasarCheckpointConfig.from_dict` returns the base model's own config class
(LlamaConfig, ...) with `quantization_config`, so the model is the base class, quantized by
QuasarHfQuantizer. A marked config.json without a Quasar `quantization_config` is refused.

Limit: a model class named directly (`LlamaForCausalLM.from_pretrained`) reads config.json with its
own config class and does not consult `AutoConfig`; such a load of a marked checkpoint without
quasar_hf is still misread (Transformers only logs that the model types differ).

Checkpoints saved before the mark (model_type of the base model) load with quasar_hf as before;
`quasar-hf mark PATH` marks them in place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

from quasar_hf import compat
from quasar_hf.atomic_folder import write_text_atomically
from quasar_hf.detect import QUANT_METHOD

MODEL_TYPE = "quasar_hf"
BASE_KEY = "quasar_base_model_type"
CODE_FILE = "quasar_hf_config.py"
CLASS_REF = "quasar_hf_config.QuasarCheckpointConfig"
INSTALL = "pip install quasar-hf"

CODE = f'''"""The config of a Quasar W8A8 checkpoint (quasar_hf): its int8 weights load only through quasar_hf."""

import importlib

try:
    QuasarCheckpointConfig = importlib.import_module("quasar_hf.hf.checkpoint_config").QuasarCheckpointConfig
except ImportError as error:
    raise ImportError(
        "This is a Quasar W8A8 checkpoint: its int8 weights and scales load only with the quasar_hf package. "
        "Install it ({INSTALL}), then `import quasar_hf` before from_pretrained."
    ) from error
'''


class QuasarCheckpointConfig(PretrainedConfig):
    """The AutoConfig entry of model_type "quasar_hf": builds the base model's own config."""

    model_type = MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        base = unmarked(config_dict)
        return CONFIG_MAPPING[base["model_type"]].from_dict(base, **kwargs)


def unmarked(config_dict: dict[str, Any]) -> dict[str, Any]:
    """A marked config.json's contents as the base model's config (model_type restored, mark removed)."""
    base_type = config_dict.get(BASE_KEY)
    quant = config_dict.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != QUANT_METHOD:
        raise ValueError(
            f'This config.json says model_type "{MODEL_TYPE}" (a Quasar W8A8 checkpoint) but has no quantization_config '
            f'with quant_method "{QUANT_METHOD}", so its int8 tensors cannot be read. Restore the config.json saved '
            "with these weights, or re-save the model from quasar_hf."
        )
    if not isinstance(base_type, str) or base_type not in CONFIG_MAPPING:
        raise ValueError(
            f"This Quasar checkpoint's config.json names base model type {base_type!r} ({BASE_KEY}), which this "
            "Transformers does not know: restore the config.json saved with these weights, or upgrade transformers."
        )
    base = {key: value for key, value in config_dict.items() if key != BASE_KEY}
    base["model_type"] = base_type
    auto_map = {name: ref for name, ref in (base.get("auto_map") or {}).items() if ref != CLASS_REF}
    if auto_map:
        base["auto_map"] = auto_map
    else:
        base.pop("auto_map", None)
    return base


def marked(config_dict: dict[str, Any]) -> dict[str, Any]:
    """A Quasar checkpoint's config.json contents with the mark (idempotent)."""
    if config_dict.get("model_type") == MODEL_TYPE:
        return dict(config_dict)
    out = dict(config_dict)
    out[BASE_KEY] = config_dict["model_type"]
    out["model_type"] = MODEL_TYPE
    out["auto_map"] = {**(config_dict.get("auto_map") or {}), "AutoConfig": CLASS_REF}
    return out


def mark_checkpoint(folder: str | os.PathLike) -> None:
    """Mark the Quasar checkpoint saved in `folder`: its config.json and the file it names. Refuses,
    before writing anything, a folder that is not a Quasar checkpoint or cannot carry the mark."""
    folder = Path(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    quant = config.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != QUANT_METHOD:
        raise ValueError(f"{folder} is not a Quasar checkpoint (its quant_method is {method!r}, not {QUANT_METHOD!r})")
    reason = why_unmarkable(config)
    if reason is not None:
        raise ValueError(f"{folder} cannot be marked: {reason}")
    write_text_atomically(folder / CODE_FILE, CODE)
    write_text_atomically(config_path, json.dumps(marked(config), indent=2, sort_keys=True) + "\n")


def why_unmarkable(config_dict: dict[str, Any]) -> str | None:
    """Why this (unmarked) config.json cannot carry the mark, or None: the mark's AutoConfig entry would
    replace a config class of the model's own custom code, or its type is unknown to this Transformers."""
    if config_dict.get("model_type") == MODEL_TYPE:
        return None
    own = (config_dict.get("auto_map") or {}).get("AutoConfig")
    if own is not None and own != CLASS_REF:
        return f"its config class comes from the model's own code ({own}), which the mark's AutoConfig entry would replace"
    if config_dict.get("model_type") not in CONFIG_MAPPING:
        return f"its model type {config_dict.get('model_type')!r} is not one this Transformers knows"
    return None


def is_marked(folder: str | os.PathLike) -> bool:
    """True when `folder/config.json` carries the mark."""
    config_path = Path(folder) / "config.json"
    return config_path.is_file() and json.loads(config_path.read_text()).get("model_type") == MODEL_TYPE


def register_checkpoint_config() -> None:
    """Register model_type "quasar_hf" with AutoConfig (harmless to call again), and silence the type-mismatch
    warning of a model class reading a marked config.json (right once quasar_hf is imported)."""
    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, QuasarCheckpointConfig)
    compat.quiet_config_type_warning(MODEL_TYPE)
