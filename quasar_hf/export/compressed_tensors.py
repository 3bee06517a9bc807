"""Export a Quasar W8A8 verifier in the compressed-tensors "int-quantized" layout (vLLM / SGLang).

The layout (what llm-compressor writes for a W8A8-INT8 model, and what vLLM's
`CompressedTensorsW8A8Int8` scheme and Transformers' compressed-tensors quantizer load):
  * every quantized Linear stores `weight` int8 [out, in] and `weight_scale` fp32 [out, 1]
    (symmetric, per output channel: W ~= weight * weight_scale);
  * input activations are quantized dynamically, symmetric, per token, to int8;
  * config.json carries `quantization_config` with quant_method "compressed-tensors",
    format "int-quantized", one config group targeting `Linear`, and an `ignore` list naming
    every Linear kept in high precision (always `lm_head`).

Hadamard-rotated linears (RotatedW8A8Linear, the default for `down_proj`) store W Q as above and
their rotation as a compressed-tensors input transform (`export/ct_transforms.py`), listed under
`quantization_config.transform_config`; vLLM and compressed-tensors apply it online, Transformers'
loader does not: `config.json["quasar_export"]` and the export's README.md say which loader reads
the export right (`export/card.py`).

SmoothQuant factors folded into the RMSNorm weights are already part of the exported norms.
A W8A8Linear that still carries an unfolded `act_prescale` p computes `(x * p) @ W.T`, which
equals `x @ (W * p).T`: the exporter folds p into the weight columns and requantizes per
channel (the only extra error of the export; measured and returned as `max_fold_rel_error`).
Pass `fold_act_prescale=False` to refuse such models instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quasar_hf.atomic_folder import atomic_folder
from quasar_hf.detect import is_quasar_model, package_version
from quasar_hf.export.card import export_card, loading_block
from quasar_hf.export.ct_transforms import transform_config_and_tensors
from quasar_hf.hf.fusion import projections_apart
from quasar_hf.ops.reference import quantize_weight_per_channel

CT_FORMAT = "int-quantized"
W8A8_KEYS = {"weight", "weight_scale", "bias", "act_prescale"}


@dataclass
class ExportReport:
    """What the export wrote: quantized and ignored module names, and the prescale-folding error."""

    out_dir: str
    quantized_modules: list[str] = field(default_factory=list)
    ignored_modules: list[str] = field(default_factory=list)
    folded_prescale_modules: list[str] = field(default_factory=list)
    rotated_modules: list[str] = field(default_factory=list)  # exported with an input transform
    max_fold_rel_error: float = 0.0  # max over modules of ||W_new - W*p||_F / ||W*p||_F


def is_w8a8_module(module: nn.Module) -> bool:
    """Duck-typed W8A8Linear: an int8 `weight` buffer beside a `weight_scale`."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.int8 and hasattr(module, "weight_scale")


def ct_quantization_config(ignore: list[str]) -> dict:
    """The `quantization_config` dict, built and validated by compressed-tensors' own pydantic models."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False)
    inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=CT_FORMAT,
        ignore=sorted(ignore),
        quantization_status="compressed",
    )
    data = config.model_dump(mode="json")
    data["quant_method"] = "compressed-tensors"
    return data


def fold_prescale(
    weight_q: torch.Tensor, weight_scale: torch.Tensor, act_prescale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """W' = dequant(W) * p[None, :], requantized per channel -> (int8 [N, K], fp32 [N], rel. Frobenius error)."""
    target = weight_q.float() * weight_scale.float()[:, None] * act_prescale.float()[None, :]  # [N, K]
    q, scale = quantize_weight_per_channel(target)
    error = (q.float() * scale[:, None] - target).norm() / target.norm().clamp_min(1e-30)
    return q, scale, float(error)


def _export_w8a8(name: str, module: nn.Module, fold: bool, report: ExportReport) -> dict[str, torch.Tensor]:
    """One W8A8 module -> its compressed-tensors tensors (weight int8, weight_scale [out, 1], bias)."""
    extra = {key for key, _ in module.named_buffers(recurse=False)} - W8A8_KEYS
    if extra:
        raise ValueError(f"{name}: unknown W8A8 tensors {sorted(extra)}; this exporter only knows {sorted(W8A8_KEYS)}")
    if getattr(module, "rotation", None) is not None:
        report.rotated_modules.append(name)
    weight_q, weight_scale = module.weight, module.weight_scale.float()
    prescale = getattr(module, "act_prescale", None)
    if prescale is not None:
        if not fold:
            raise ValueError(
                f"{name} carries an unfolded act_prescale, which the compressed-tensors layout cannot express; "
                "export with fold_act_prescale=True (folds it into the weights and requantizes)"
            )
        weight_q, weight_scale, error = fold_prescale(weight_q, weight_scale, prescale)
        report.folded_prescale_modules.append(name)
        report.max_fold_rel_error = max(report.max_fold_rel_error, error)
    tensors = {f"{name}.weight": weight_q.contiguous(), f"{name}.weight_scale": weight_scale.reshape(-1, 1).contiguous()}
    if getattr(module, "bias", None) is not None:
        tensors[f"{name}.bias"] = module.bias.detach().contiguous()
    report.quantized_modules.append(name)
    return tensors


def float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's float tensors (its embeddings): what loaders build transforms in."""
    return model.get_input_embeddings().weight.dtype


def collect_tensors(model: nn.Module, fold: bool, report: ExportReport) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(the full exported state dict, the transform_config or None): compressed W8A8 modules, the
    rotations of rotated ones, and every other tensor as the model holds it."""
    with projections_apart(model):  # each fused projection a module of its own, as the checkpoint names it
        return _collect_tensors(model, fold, report)


def _collect_tensors(model: nn.Module, fold: bool, report: ExportReport) -> tuple[dict[str, torch.Tensor], dict | None]:
    tensors: dict[str, torch.Tensor] = {}
    handled: set[str] = set()
    rotations = {}
    for name, module in model.named_modules():
        if is_w8a8_module(module):
            tensors.update(_export_w8a8(name, module, fold, report))
            handled.update(f"{name}.{key}" for key, _ in module.named_buffers(recurse=False))
            if getattr(module, "rotation", None) is not None:
                rotations[name] = module.rotation
        elif isinstance(module, nn.Linear):
            report.ignored_modules.append(name)
    transform_config = None
    if rotations:
        transform_config, transform_tensors = transform_config_and_tensors(rotations, float_dtype(model))
        tensors.update(transform_tensors)
    seen_storage: set[int] = set()
    for key, value in model.state_dict().items():
        if key in handled:
            continue
        if value.device.type == "meta":
            raise ValueError(f"{key} is on the meta device; load the model fully (no disk offload) before exporting")
        pointer = value.untyped_storage().data_ptr()
        if pointer in seen_storage and key.endswith("lm_head.weight"):
            continue  # tied to the embeddings: saved once, re-tied on load (tie_word_embeddings)
        seen_storage.add(pointer)
        tensors[key] = value.detach().contiguous()
    return tensors, transform_config


def export_config(model: nn.Module, ignore: list[str], transform_config: dict | None = None) -> dict:
    """config.json of the export: the model's own config with a compressed-tensors quantization_config
    (and its transform_config where linears are rotated)."""
    config = model.config.to_dict()
    config["quantization_config"] = ct_quantization_config(ignore)
    if transform_config is not None:
        config["quantization_config"]["transform_config"] = transform_config
    return config


def _refuse_source_folder(model: nn.Module, out: Path) -> None:
    """Never write the export over the checkpoint the model was loaded from (symlinks resolved)."""
    source = getattr(model, "name_or_path", None)
    if not source or not os.path.isdir(source):
        return
    origin, target = Path(source).resolve(), out.expanduser().resolve()
    if target == origin or origin in target.parents:
        raise ValueError(
            f"out_dir {out} is (or lies inside) the folder the model was loaded from ({source}); "
            "exporting there would overwrite that checkpoint. Choose another folder."
        )


def export_compressed_tensors(
    model: nn.Module,
    out_dir: str | os.PathLike,
    tokenizer: object | None = None,
    fold_act_prescale: bool = True,
) -> ExportReport:
    """Write `model` (a Quasar W8A8 model) to `out_dir` in the compressed-tensors int-quantized layout."""
    from safetensors.torch import save_file

    if not is_quasar_model(model):
        raise ValueError(
            "export_compressed_tensors expects a Quasar W8A8 model (quantize it first: "
            "`quasar-hf quantize MODEL --out DIR`, or from_pretrained(..., quantization_config=QuasarConfig()))"
        )
    out = Path(out_dir)
    _refuse_source_folder(model, out)
    report = ExportReport(out_dir=str(out))
    tensors, transform_config = collect_tensors(model, fold_act_prescale, report)
    if not report.quantized_modules:
        raise ValueError("the model says it is a Quasar model but holds no int8 W8A8 modules; nothing to export")
    with atomic_folder(out) as staging:  # a failed export leaves what was in `out` as it was
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        with open(staging / "config.json", "w") as handle:
            config = export_config(model, report.ignored_modules, transform_config)
            config["quasar_export"] = loading_block(report.rotated_modules, package_version())
            json.dump(config, handle, indent=2, sort_keys=True)
        (staging / "README.md").write_text(
            export_card(
                out.name, len(report.quantized_modules), report.ignored_modules, report.rotated_modules, package_version()
            ),
            encoding="utf-8",
        )
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return report
