"""A saved Quasar checkpoint cannot disagree with itself: config.json is checked against the tensors.

Each shard's safetensors header carries `quasar_layout` (written by `layout_metadata` at save, from
the module tree): which linears are W8A8, which rotate their input and at what width, which carry
an activation prescale, which decoder linears stay float, and the draft path. At load,
`check_checkpoint_files` compares every field of `quantization_config` that changes the math with
that record and with the tensors themselves (names, dtypes, shapes, read from the headers only),
and refuses a mismatch with a message naming the field and the module; each tensor's bytes are
checked against the SHA-256 saved with them (checksums.py). A config edited by hand, a
hand-merged config or a Hub repo whose config.json was changed apart from its weights then fails
to load instead of computing garbage.

The record also keeps the settings that made the weights (alpha, rotate, weight_rounding,
modules_to_not_convert), so a config.json edited to describe other settings is refused too. A
shard with a record must carry a SHA-256 for every tensor (a renamed or removed digest entry is refused).
Checkpoints saved before the record existed load as before (the tensor checks still run); saving
them again adds it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from torch import nn

from quasar_hf.hf.checksums import check_file_digests, checks_enabled
from quasar_hf.hf.config import QuasarConfig
from quasar_hf.hf.fusion import checkpoint_linears
from quasar_hf.nn import RotatedW8A8Linear, W8A8Linear

LAYOUT_KEY = "quasar_layout"
EXPECTED_DTYPES = {"weight": "I8", "weight_scale": "F32", "act_prescale": "F32"}
_FIX = "config.json was edited or belongs to another save: restore the config.json saved with these weights, or re-save the model from quasar_hf."

logger = logging.getLogger(__name__)


def layout_metadata(model: nn.Module, config: QuasarConfig) -> dict[str, str]:
    """The safetensors header entry describing what the saved tensors compute (a JSON string)."""
    modules = dict(model.named_modules())
    w8a8 = checkpoint_linears(model)  # a fused group's members under their own names
    draft = config.draft_info or {}
    layout = {
        "quantized_modules": sorted(w8a8),
        "rotated_modules": {n: m.in_features for n, m in sorted(w8a8.items()) if isinstance(m, RotatedW8A8Linear)},
        "prescaled_modules": sorted(n for n, m in w8a8.items() if m.act_prescale is not None),
        "keep_float": sorted(n for n in (config.keep_float_info or {}).get("modules") or [] if _is_float_linear(modules.get(n))),
        "draft_layers": list(draft.get("layers") or []),
        "draft_dtype": draft.get("dtype"),
        "draft_vocab_size": draft.get("vocab_size"),
        "recipe": _recipe(config),
    }
    return {LAYOUT_KEY: json.dumps(layout, sort_keys=True)}


RECIPE_FIELDS = ("alpha", "rotate", "weight_rounding", "modules_to_not_convert")


def _recipe(config: QuasarConfig) -> dict[str, Any]:
    """The settings that made the weights (JSON values): config.json must keep describing them."""
    return {name: json.loads(json.dumps(getattr(config, name))) for name in RECIPE_FIELDS}


def _is_float_linear(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Linear) and not isinstance(module, W8A8Linear) and module.weight.is_floating_point()


def check_checkpoint_files(checkpoint_files: list[str] | None, config: QuasarConfig) -> None:
    """Safetensors only; every quantized tensor present with the right dtype and shape; every
    math-changing config field equal to what the tensors (and the saved layout record) say."""
    if not checkpoint_files:
        return
    pickled = [f for f in checkpoint_files if not str(f).endswith(".safetensors")]
    if pickled:
        raise ValueError(
            f"Quasar checkpoints load from safetensors only (never unpickled); got {pickled}. "
            "Re-save the model with save_pretrained(safe_serialization=True)."
        )
    tensors, layouts = _read_headers(checkpoint_files)
    _check_quantized_tensors(tensors, config, [os.path.basename(f) for f in checkpoint_files])
    if checks_enabled():
        for path in checkpoint_files:
            check_file_digests(str(path), required=str(path) in layouts)
    if not layouts:
        logger.warning(
            "This Quasar checkpoint predates the layout record that lets a load check config.json against the "
            "weights; it loads as before. Save it again with quasar_hf to add the record."
        )
        return
    if len({json.dumps(layout, sort_keys=True) for layout in layouts.values()}) > 1:
        raise ValueError(f"the shards of this Quasar checkpoint come from different saves (their {LAYOUT_KEY} differ); {_FIX}")
    _check_layout(next(iter(layouts.values())), config)


def _read_headers(checkpoint_files: list[str]) -> tuple[dict[str, tuple[str, list[int]]], dict[str, dict]]:
    """{tensor name: (dtype, shape)} over all shards, and {shard path: its layout record (parsed)}."""
    from safetensors import safe_open

    tensors: dict[str, tuple[str, list[int]]] = {}
    layouts = {}
    for path in checkpoint_files:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                piece = handle.get_slice(key)
                tensors[key] = (piece.get_dtype(), list(piece.get_shape()))
            record = (handle.metadata() or {}).get(LAYOUT_KEY)
        if record is not None:
            try:
                layouts[str(path)] = json.loads(record)
            except json.JSONDecodeError:
                raise ValueError(
                    f"{os.path.basename(path)}: its {LAYOUT_KEY} header entry is not JSON; the file was modified."
                ) from None
    return tensors, layouts


def _find(tensors: dict, key: str) -> str | None:
    """The stored name of `key` (the checkpoint may carry a prefix, e.g. a base model's)."""
    return key if key in tensors else next((k for k in tensors if k.endswith("." + key)), None)


def _check_quantized_tensors(tensors: dict[str, tuple[str, list[int]]], config: QuasarConfig, files: list[str]) -> None:
    quantized = set(config.quantized_modules or [])
    stray = sorted(
        key[: -len(".weight")]
        for key, (dtype, _) in tensors.items()
        if dtype == EXPECTED_DTYPES["weight"]
        and key.endswith(".weight")
        and not any(key == f"{name}.weight" or key.endswith(f".{name}.weight") for name in quantized)
    )
    if stray:
        raise ValueError(
            f"Quasar checkpoint holds int8 weights for {stray[:5]}{' ...' if len(stray) > 5 else ''}, but its config's "
            "quantization_config.quantized_modules does not list them, so they would load into float layers. "
            "The config.json was edited or belongs to another save: re-save the model from quasar_hf."
        )
    prescaled = set(config.prescaled_modules or [])
    for name in config.quantized_modules or []:
        shapes = {}
        for suffix in ("weight", "weight_scale", "act_prescale"):
            alias = _find(tensors, f"{name}.{suffix}")
            if alias is None:
                if suffix == "act_prescale" and name in prescaled:
                    raise ValueError(
                        f"quantization_config.prescaled_modules lists {name!r}, but the checkpoint holds no act_prescale "
                        f"for it (its weight was not scaled for one); {_FIX}"
                    )
                if suffix != "act_prescale":
                    raise ValueError(
                        f"Quasar checkpoint is missing tensor '{name}.{suffix}' in {files}; the checkpoint is incomplete. "
                        "Re-save it, or re-quantize the original model."
                    )
                continue
            if suffix == "act_prescale" and name not in prescaled:
                raise ValueError(
                    f"quantization_config.prescaled_modules does not list {name!r}, but the checkpoint holds its "
                    f"act_prescale (its weight was scaled for it); {_FIX}"
                )
            dtype, shapes[suffix] = tensors[alias]
            if dtype != EXPECTED_DTYPES[suffix] and suffix == "weight":
                raise ValueError(
                    f"Quasar checkpoint tensor '{name}.weight' has dtype {dtype}, expected I8: quantization_config."
                    f"quantized_modules lists {name!r}, but its weight was saved unquantized. The file was converted, "
                    f"or {_FIX}"
                )
            if dtype != EXPECTED_DTYPES[suffix]:
                raise ValueError(
                    f"Quasar checkpoint tensor '{name}.{suffix}' has dtype {dtype}, expected {EXPECTED_DTYPES[suffix]}; "
                    "the checkpoint was modified or converted. Re-save it from quasar_hf."
                )
        _check_shapes(name, shapes)


def _check_shapes(name: str, shapes: dict[str, list[int]]) -> None:
    """weight [out, in] int8, weight_scale [out] (one per output channel), act_prescale [in]."""
    weight = shapes["weight"]
    if len(weight) != 2:
        raise ValueError(f"Quasar checkpoint tensor '{name}.weight' has shape {weight}, expected [out_features, in_features].")
    wanted = {"weight_scale": [weight[0]], "act_prescale": [weight[1]]}
    for suffix, shape in shapes.items():
        if suffix in wanted and shape != wanted[suffix]:
            raise ValueError(
                f"Quasar checkpoint tensor '{name}.{suffix}' has shape {shape}, but {name}.weight is {weight}, so "
                f"{suffix} must be {wanted[suffix]} (one scale per {'output' if suffix == 'weight_scale' else 'input'} "
                "channel). The checkpoint was modified or its files mixed from different saves: re-save it from quasar_hf."
            )


def _check_layout(layout: dict[str, Any], config: QuasarConfig) -> None:
    """Each math-changing field of `config` against the record written with the tensors."""
    saved_recipe = layout.get("recipe")  # absent in records written before it
    if saved_recipe is not None:
        listed_recipe = _recipe(config)
        for name in RECIPE_FIELDS:
            if name in saved_recipe and listed_recipe[name] != saved_recipe[name]:
                raise ValueError(
                    f"quantization_config.{name} is {listed_recipe[name]!r}, but these weights were made with "
                    f"{saved_recipe[name]!r}; {_FIX}"
                )
    rotated = layout.get("rotated_modules") or {}
    _same_names("quantized_modules", config.quantized_modules, layout.get("quantized_modules"))
    _same_names("rotated_modules", config.rotated_modules, list(rotated))
    _same_names("prescaled_modules", config.prescaled_modules, layout.get("prescaled_modules"))
    sizes = sorted((config.rotation_info or {}).get("sizes") or {}, key=str)
    widths = sorted({str(width) for width in rotated.values()})
    if sizes != widths:
        users = {w: sorted(n for n, v in rotated.items() if str(v) == w) for w in widths}
        raise ValueError(
            f"quantization_config.rotation_info.sizes lists widths {sizes}, but the checkpoint's rotated linears "
            f"have input widths {widths} ({', '.join(f'{w}: {u[0]}' for w, u in users.items()) or 'none'}); {_FIX}"
        )
    kept = layout.get("keep_float") or []
    _same_names("keep_float_info.modules", (config.keep_float_info or {}).get("modules"), kept)
    if isinstance(config.keep_float, list):
        _same_names("keep_float", config.keep_float, kept)
    draft = config.draft_info or {}
    for field, key in (("layers", "draft_layers"), ("dtype", "draft_dtype"), ("vocab_size", "draft_vocab_size")):
        saved = layout.get(key)
        listed = draft.get(field)
        if field == "layers":
            saved, listed = list(saved or []), list(listed or [])
        if listed != saved:
            raise ValueError(
                f"quantization_config.draft_info.{field} is {listed!r}, but the checkpoint's draft path was saved with "
                f"{field} {saved!r}; {_FIX}"
            )
    requested = {"draft_layers": config.draft_layers, "draft_vocab_size": config.draft_vocab_size}
    if isinstance(requested["draft_layers"], str):  # "auto": the search chose draft_info.layers
        del requested["draft_layers"]
    for field, value in requested.items():
        saved = layout.get(field)
        if (list(value or []) if field == "draft_layers" else value) != (list(saved or []) if field == "draft_layers" else saved):
            raise ValueError(
                f"quantization_config.{field} is {value!r}, but the checkpoint's draft path was built with {saved!r}; {_FIX}"
            )


def _same_names(field: str, listed: list[str] | None, saved: list[str] | None) -> None:
    listed_set, saved_set = set(listed or []), set(saved or [])
    if listed_set == saved_set:
        return
    extra, missing = sorted(listed_set - saved_set), sorted(saved_set - listed_set)
    parts = (
        [f"lists {extra[0]!r}" + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else "") + ", which the tensors do not"]
        if extra
        else []
    )
    if missing:
        parts.append(
            f"omits {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "") + ", which the tensors hold"
        )
    raise ValueError(f"quantization_config.{field} {' and '.join(parts)}; {_FIX}")
