"""QuasarHfQuantizer: the lifecycle hooks Transformers calls during `from_pretrained`.

This is the only module that implements Transformers' quantizer hooks (they move between 5.x
releases). The work itself lives in `quasar_hf.hf.quantize_on_load`; after loading, the model gets the
row-stable attention and lm_head and its Quasar methods (`quasar_hf.hf.binding`).
"""

from __future__ import annotations

import os

import torch
from transformers.quantizers.base import HfQuantizer

from quasar_hf.hf.binding import bind_quasar_methods
from quasar_hf.hf.config import QuasarConfig
from quasar_hf.hf.quantize_on_load import (
    fold_norms,
    quantize_model,
    replace_with_w8a8_skeleton,
    use_rowstable_lm_head,
    use_rowstable_norms,
)
from quasar_hf.nn import W8A8Linear, prepare_weights
from quasar_hf.ops.rowstable_attention import use_rowstable_attention

_EXPECTED_DTYPES = {"weight": "I8", "weight_scale": "F32", "act_prescale": "F32"}


class QuasarHfQuantizer(HfQuantizer):
    """Quantize-on-load (calibrate -> smooth -> W8A8) or load a saved Quasar checkpoint as is."""

    requires_calibration = False
    quantization_config: QuasarConfig

    def __init__(self, quantization_config: QuasarConfig, **kwargs) -> None:
        super().__init__(quantization_config, **kwargs)

    def validate_environment(self, *args, **kwargs) -> None:
        if not isinstance(self.quantization_config, QuasarConfig):
            raise TypeError("QuasarHfQuantizer needs a QuasarConfig")

    @property
    def quantized_element_size(self) -> float | None:
        return None  # weights load in float and are quantized after loading (or load as int8 directly)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return False

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if self.pre_quantized:
            _check_checkpoint_files(checkpoint_files, self.quantization_config)
            replace_with_w8a8_skeleton(model, self.quantization_config)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        if self.pre_quantized:
            _check_loaded_modules(model)
        else:
            quantize_model(model, config)
        model.config.quantization_config = config
        prepare_weights(model)  # every W8A8 kernel validated, packed and bound once
        fold_norms(model, config)  # q/k/v and gate/up: the RMSNorm before them and their GEMMs in one call
        # Decode and verification attention rows bit-identical (C kernel on CPU, Triton on CUDA), so
        # generate(quasar=True) equals plain greedy generate of this model in one verify call per layer.
        use_rowstable_attention(model)
        use_rowstable_lm_head(model)  # and logits: verify rows equal decode steps even at near-ties
        use_rowstable_norms(model)  # the other norms: one opaque op each when compiled
        bind_quasar_methods(model)  # generate(quasar=...), save_pretrained / push_to_hub with the model card
        return model

    def is_serializable(self, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        """Compiled steps are row-stable: every reduction is an op of ours (W8A8 GEMMs, attention, lm_head)
        or a per-row norm, so compiled `quasar=True` gives the tokens of compiled plain greedy decoding
        with the same CompileConfig (tests/test_static_steps.py); compiled need not equal eager."""
        return True


def _check_checkpoint_files(checkpoint_files: list[str] | None, config: QuasarConfig) -> None:
    """Safetensors only, and every quantized tensor present with the right dtype (checked from headers)."""
    if not checkpoint_files:
        return
    pickled = [f for f in checkpoint_files if not str(f).endswith(".safetensors")]
    if pickled:
        raise ValueError(
            f"Quasar checkpoints load from safetensors only (never unpickled); got {pickled}. "
            "Re-save the model with save_pretrained(safe_serialization=True)."
        )
    from safetensors import safe_open

    dtypes: dict[str, str] = {}
    for path in checkpoint_files:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                dtypes[key] = handle.get_slice(key).get_dtype()
    quantized = set(config.quantized_modules or [])
    stray = sorted(
        key[: -len(".weight")]
        for key, dtype in dtypes.items()
        if dtype == _EXPECTED_DTYPES["weight"]
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
        wanted = ["weight", "weight_scale"] + (["act_prescale"] if name in prescaled else [])
        for suffix in wanted:
            key = f"{name}.{suffix}"
            alias = next((k for k in dtypes if k == key or k.endswith("." + key)), None)
            if alias is None:
                raise ValueError(
                    f"Quasar checkpoint is missing tensor {key!r} in {[os.path.basename(f) for f in checkpoint_files]}; "
                    "the checkpoint is incomplete. Re-save it, or re-quantize the original model."
                )
            if dtypes[alias] != _EXPECTED_DTYPES[suffix]:
                raise ValueError(
                    f"Quasar checkpoint tensor {key!r} has dtype {dtypes[alias]}, expected {_EXPECTED_DTYPES[suffix]}; "
                    "the checkpoint was modified or converted. Re-save it from quasar_hf."
                )


def _check_loaded_modules(model: torch.nn.Module) -> None:
    """After loading: int8 weights and fp32 scales really landed in every W8A8Linear."""
    for name, module in model.named_modules():
        if not isinstance(module, W8A8Linear):
            continue
        if module.weight.dtype != torch.int8 or module.weight.device.type == "meta":
            raise ValueError(f"{name}.weight did not load as int8 (got {module.weight.dtype} on {module.weight.device})")
        for attr in ("weight_scale", "act_prescale"):
            tensor = getattr(module, attr)
            if tensor is not None and tensor.dtype != torch.float32:
                tensor.data = tensor.data.float()  # a loader cast it: the values are fp32-exact upcasts
