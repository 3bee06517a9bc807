"""Quantize-on-load and reload: calibration text, draft path, layer-by-layer W8A8 (no Transformers internals here)."""

from __future__ import annotations

import hashlib
import logging
import time

import torch
from torch import nn

from quasar_hf import compat
from quasar_hf.detect import package_version
from quasar_hf.hf.checksums import tensor_bytes
from quasar_hf.hf.config import QUASAR_FORMAT_VERSION, WRITTEN_BY_QUANTIZER, QuasarConfig
from quasar_hf.hf.resume_state import ResumeState, fingerprint
from quasar_hf.hf.sequential import DEFAULT_LAYER_INPUTS, quantize_layers_sequentially
from quasar_hf.nn import RotatedW8A8Linear, RowStableLinear, RowStableRMSNorm, W8A8Linear
from quasar_hf.nn.rowstable_norm import rms_norm_formula
from quasar_hf.nn.weight_bytes import module_bytes
from quasar_hf.ops.hadamard import ROTATION_CONSTRUCTION, rotation_layout
from quasar_hf.self_draft.head import attach_draft_head_skeleton, build_draft_head
from quasar_hf.self_draft.layer_search import (
    draft_byte_ratio,
    expected_acceptance_length,
    predicted_speedup,
    select_draft_layers,
    top1_agreement,
)
from quasar_hf.self_draft.path import attach_draft_layers
from quasar_hf.smoothquant.data import MIN_BLOCK_TOKENS, build_calibration_blocks, load_calibration_texts
from quasar_hf.smoothquant.keep_float import KeepFloatSelector
from quasar_hf.smoothquant.mappings import model_decoder_layers, resolve_mappings
from quasar_hf.smoothquant.phase_times import PhaseTimes
from quasar_hf.smoothquant.placement import check_calibration_device_here, compute_device_for

logger = logging.getLogger(__name__)


def _excluded(name: str, patterns: list[str]) -> bool:
    return any(name == p or name.endswith("." + p) or name.startswith(p + ".") for p in patterns)


def find_quantizable_linears(model: nn.Module, layers_path: str, modules_to_not_convert: list[str]) -> list[str]:
    """Full names of the nn.Linear modules inside the decoder layers that will become W8A8."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith(layers_path + ".") and not _excluded(name, modules_to_not_convert):
            names.append(name)
    if not names:
        raise ValueError(f"found no nn.Linear to quantize under {layers_path!r} (all excluded by modules_to_not_convert?)")
    return names


def replace_with_w8a8_skeleton(model: nn.Module, config: QuasarConfig) -> None:
    """Before loading a saved Quasar checkpoint: empty W8A8Linear modules (and draft copies) where the config says."""
    draft = config.draft_info or {}
    if draft.get("layers") and draft.get("dtype") == "model":
        attach_draft_layers(model, draft["layers"])  # copies of float skeleton layers, before the swap below
    attach_draft_head_skeleton(model, draft)
    if not config.quantized_modules:
        raise ValueError(
            "this Quasar checkpoint's quantization_config lists no quantized_modules; it was not written by "
            "quasar_hf's quantizer. Re-quantize the original model with QuasarConfig()."
        )
    prescaled = set(config.prescaled_modules or [])
    rotated = set(config.rotated_modules or [])
    if rotated - set(config.quantized_modules) or rotated & prescaled:
        raise ValueError(
            "this Quasar checkpoint's quantization_config lists rotated_modules that are not quantized, or also "
            "prescaled; the config.json was edited or belongs to another save: re-save the model from quasar_hf."
        )
    for name in config.quantized_modules:
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"checkpoint lists quantized module {name!r}, which this model does not have") from None
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"checkpoint lists {name!r} as quantized, but it is a {type(linear).__name__}")
        if name in rotated:
            check_rotation(linear.in_features, config.rotation_info)
        kind = RotatedW8A8Linear if name in rotated else W8A8Linear
        skeleton = kind.shaped_like(linear, config.backend, has_act_prescale=name in prescaled)
        model.set_submodule(name, skeleton)


def rotation_info(sizes: set[int]) -> dict:
    """What the quantizer records of the rotations it used, so a reload can check it builds the same Q."""
    return {"construction": ROTATION_CONSTRUCTION, "sizes": {str(k): rotation_layout(k) for k in sorted(sizes)}}


def check_rotation(size: int, info: dict | None) -> None:
    """Raise unless this quasar_hf builds the very rotation of rows of `size` the checkpoint was made with."""
    saved = ((info or {}).get("sizes") or {}).get(str(size))
    if (info or {}).get("construction") != ROTATION_CONSTRUCTION or saved != rotation_layout(size):
        raise ValueError(
            f"this Quasar checkpoint rotates inputs of width {size} with {info!r}, but this quasar_hf builds "
            f"{ROTATION_CONSTRUCTION!r} {rotation_layout(size)}: its int8 weights would meet a different rotation. "
            "Load it with the quasar_hf version that saved it, or re-quantize the original model."
        )


def use_rowstable_norms(model: nn.Module) -> int:
    """Replace every RMSNorm of a known class left after fuse_projections (the final norm, q/k norms, ...)
    with a RowStableRMSNorm over the same Parameter: compiled, each is one opaque op whose rows are
    reduced alone (nn/rowstable_norm.py). Norms that Accelerate dispatches stay. Returns how many."""
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module) is RowStableRMSNorm or rms_norm_formula(module) is None or compat.has_accelerate_hook(module):
            continue
        model.set_submodule(name, RowStableRMSNorm(module))
        replaced += 1
    return replaced


def use_rowstable_lm_head(model: nn.Module) -> bool:
    """Compute the float lm_head with `RowStableLinear` (same Parameters, so ties and checkpoints are
    unchanged): verify-step logits then equal decode-step logits bit for bit. True if replaced."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear or not hasattr(model, "set_output_embeddings"):
        return False  # already replaced, quantized, or not a plain linear: left as it is
    replacement = RowStableLinear.from_linear(head)
    if compat.has_accelerate_hook(head) and not compat.move_accelerate_hook(head, replacement):
        return False  # an offloaded head: accelerate's hook owns its weights
    model.set_output_embeddings(replacement)
    return True


def _load_tokenizer(model: nn.Module, config: QuasarConfig):
    from transformers import AutoTokenizer

    tok = config.tokenizer
    if tok is not None and not isinstance(tok, (str, bytes)) and callable(tok):
        return tok
    from quasar_hf import compat

    source = tok or compat.name_or_path(model) or None
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as err:
        raise ValueError(
            f"Quasar calibration needs a tokenizer and could not load one from {source!r} ({err}). "
            "Pass QuasarConfig(tokenizer=<tokenizer or path>)."
        ) from None


def check_calibration_length(seq_len: int, model: nn.Module) -> None:
    """Blocks long enough to measure activations, and no longer than the model's context."""
    if seq_len < MIN_BLOCK_TOKENS:
        raise ValueError(
            f"calibration_seq_len={seq_len} is too short to calibrate on: activation statistics and GPTQ need blocks of "
            f"at least {MIN_BLOCK_TOKENS} tokens (512, the default, to 2048 is typical)"
        )
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if isinstance(context, int) and seq_len > context:
        raise ValueError(
            f"calibration_seq_len={seq_len} is longer than the model's context ({context} tokens, "
            f"max_position_embeddings): use calibration_seq_len <= {context}"
        )


def calibration_blocks(model: nn.Module, config: QuasarConfig) -> tuple[torch.Tensor, str]:
    """(blocks [N, T] of token ids, source description) from the configured calibration text."""
    check_calibration_length(config.calibration_seq_len, model)
    tokenizer = _load_tokenizer(model, config)
    texts, source = load_calibration_texts(
        config.calibration_dataset, config.calibration_text_column, config.calibration_split, tokenizer
    )
    blocks = build_calibration_blocks(texts, tokenizer, config.num_calibration_samples, config.calibration_seq_len, config.seed)
    return blocks, source


@torch.no_grad()
def quantize_model(
    model: nn.Module, config: QuasarConfig, progress: bool = True, layer_inputs: str = DEFAULT_LAYER_INPUTS
) -> dict:
    """Calibrate, smooth and quantize `model` in place, one decoder layer at a time.

    Returns a summary and records it in `config`. `layer_inputs` says which activations feed the
    next layer's calibration: "quantized" (the W8A8 layer's outputs) or "float".
    """
    started = time.perf_counter()
    check_calibration_device_here(config.calibration_device)
    times = PhaseTimes()
    arch = resolve_mappings(model, config.smoothquant_mappings)
    names = find_quantizable_linears(model, arch.layers_path, config.modules_to_not_convert)
    with times.phase("calibration_text"):
        blocks, source = calibration_blocks(model, config)
    if config.draft_layers is not None:
        with times.phase("draft_path"):
            config.draft_info = build_draft_path(model, config, blocks, progress)
            if config.draft_vocab_size is not None:
                config.draft_info.update(build_draft_head(model, config.draft_vocab_size, blocks))
    keep = None
    if config.keep_float is not None:
        keep = KeepFloatSelector(config.keep_float, config.keep_float_budget, model, names)
    with times.phase("resume_fingerprint"):
        resume = resume_state(model, config, blocks, layer_inputs, keep is not None)
    result = quantize_layers_sequentially(model, arch, names, blocks, config, layer_inputs, progress, keep, times, resume)
    kept = keep.apply(model) if keep is not None else []
    config.keep_float_info = keep.info() if keep is not None else None

    config.quantized_modules = [n for n in names if n not in kept]
    config.prescaled_modules = sorted(set(result.prescales) - set(kept))
    config.rotated_modules = sorted(set(result.rotated) - set(kept))
    config.rotation_info = rotation_info({model.get_submodule(n).in_features for n in config.rotated_modules})
    config.searched_alphas = result.alphas if config.alpha == "auto" else None
    config.calibration_info = {
        "source": source,
        "num_samples": int(blocks.shape[0]),
        "seq_len": int(blocks.shape[1]),
        "tokens": int(blocks.numel()),
        "layer_inputs": layer_inputs,
        "math_dtype": result.math_dtype,
        "math_dtype_reason": result.math_dtype_reason,
        "device": result.compute_device,
        "seconds": round(time.perf_counter() - started, 2),
        "timing": times.summary(),
    }
    return config.calibration_info


def resume_state(
    model: nn.Module, config: QuasarConfig, blocks: torch.Tensor, layer_inputs: str, keeps_float: bool
) -> ResumeState | None:
    """The resume folder of this run (config.resume_dir), keyed by everything its result depends on:
    the settings, the calibration tokens, every weight's bytes, the versions. None without a folder."""
    if config.resume_dir is None:
        return None
    if keeps_float:
        logger.warning("keep_float selects across all layers at once: this quantization cannot resume, it saves no state")
        return None
    weights = hashlib.sha256()
    for name, tensor in compat.state_dict_values(model):  # offloaded weights read from their hooks, one at a time
        weights.update(name.encode())
        weights.update(tensor_bytes(tensor))
    settings = {k: v for k, v in config.to_dict().items() if k not in WRITTEN_BY_QUANTIZER}
    key = fingerprint(
        {
            "settings": settings,
            "calibration_dataset": repr(config.calibration_dataset),
            "layer_inputs": layer_inputs,
            "compute": compute_device_for(
                config.calibration_device, torch.device("cpu")
            ).type,  # another device's kernels may round otherwise
            "blocks": hashlib.sha256(blocks.numpy().tobytes()).hexdigest(),
            "weights": weights.hexdigest(),
            "model": type(model).__name__,
            "versions": {"format": QUASAR_FORMAT_VERSION, "quasar_hf": package_version(), "torch": torch.__version__},
        }
    )
    return ResumeState(config.resume_dir, key)


DRAFT_SEARCH_BLOCKS = 2
DRAFT_SEARCH_TOKENS = 128


@torch.no_grad()
def build_draft_path(model: nn.Module, config: QuasarConfig, blocks: torch.Tensor, progress: bool = True) -> dict:
    """Choose (or check) the self-draft layers on calibration text and keep their float copies.

    Runs on the float model before smoothing, so draft copies hold the original weights.
    """
    sample = blocks[:DRAFT_SEARCH_BLOCKS, :DRAFT_SEARCH_TOKENS]
    num_layers = len(model_decoder_layers(model))
    if config.draft_layers == "auto":
        found = select_draft_layers(model, sample, config.draft_budget, progress, config.draft_dtype, config.draft_vocab_size)
        layers, agreement = found["layers"], found["top1_agreement"]
        selection = f"greedy removal by top-1 agreement, size by predicted speedup per byte; {found['evaluations']} evaluations"
        candidates = found["candidates"]
    else:
        layers = list(config.draft_layers)
        bad = [i for i in layers if i >= num_layers]
        if bad:
            raise ValueError(
                f"draft_layers {bad} are out of range: this model has {num_layers} decoder layers (0..{num_layers - 1})"
            )
        device = compat.input_device(model)
        reference = torch.stack([model(input_ids=b[None].to(device), use_cache=False).logits[0].argmax(-1).cpu() for b in sample])
        agreement, selection, candidates = top1_agreement(model, layers, sample, reference), "user", None
    ratio = draft_byte_ratio(model, layers, config.draft_dtype, config.draft_vocab_size)
    speedup, draft_tokens = predicted_speedup(agreement, ratio)
    extra = 0
    if config.draft_dtype == "model":
        extra = module_bytes(attach_draft_layers(model, layers))
    return {
        "layers": layers,
        "dtype": config.draft_dtype,
        "selection": selection,
        "top1_agreement": round(agreement, 4),
        "expected_acceptance_length_k5": round(expected_acceptance_length(agreement, 5), 3),
        "draft_over_verify_bytes": round(ratio, 4),
        "predicted_speedup": round(speedup, 4),
        "predicted_best_draft_tokens": draft_tokens,
        "candidates": candidates,
        "agreement_measured_on": f"{sample.shape[0]} x {sample.shape[1]} calibration tokens vs the float model",
        "extra_bytes": extra,
        "extra_fraction_of_model": round(extra / max(1, module_bytes(model) - extra), 4),
    }
