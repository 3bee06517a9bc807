"""QuasarHfQuantizer: the lifecycle hooks Transformers calls during `from_pretrained`.

This is the only module that implements Transformers' quantizer hooks (they move between 5.x
releases). The work itself lives in `quasar_hf.hf.quantize_on_load`; after loading, the model gets the
row-stable attention and lm_head and its Quasar methods (`quasar_hf.hf.binding`).
"""

from __future__ import annotations

import torch
from transformers.quantizers.base import HfQuantizer

from quasar_hf import compat
from quasar_hf.hf.binding import bind_quasar_methods
from quasar_hf.hf.checkpoint_checks import check_checkpoint_files, layout_metadata
from quasar_hf.hf.checksums import tensor_digests
from quasar_hf.hf.config import QuasarConfig
from quasar_hf.hf.fusion import fuse_projections
from quasar_hf.hf.quantize_on_load import (
    quantize_model,
    replace_with_w8a8_skeleton,
    use_rowstable_lm_head,
    use_rowstable_norms,
)
from quasar_hf.nn import W8A8Linear, prepare_weights
from quasar_hf.ops.rowstable_attention import use_rowstable_attention
from quasar_hf.speculative.defaults import FIELD as DEFAULT_FIELD


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
            check_checkpoint_files(checkpoint_files, self.quantization_config)
            replace_with_w8a8_skeleton(model, self.quantization_config)
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        if self.pre_quantized:
            _check_loaded_modules(model)
        else:
            quantize_model(model, config)
        model.config.quantization_config = config
        fuse_projections(model)  # norm + q/k/v, norm + gate/up: one op each (stacked and packed once)
        prepare_weights(model, unprepared_only=True)  # every other W8A8 kernel validated, packed and bound once
        # Decode and verification attention rows bit-identical (C kernel on CPU, Triton on CUDA), so
        # generate(quasar=True) equals plain greedy generate of this model in one verify call per layer.
        use_rowstable_attention(model)
        use_rowstable_lm_head(model)  # and logits: verify rows equal decode steps even at near-ties
        use_rowstable_norms(model)  # the other norms: one opaque op each when compiled
        bind_quasar_methods(model)  # generate(quasar=...), save_pretrained / push_to_hub with the model card
        say_quasar_is_the_default(model)
        return model

    def is_serializable(self, **kwargs) -> bool:
        return True

    def get_state_dict_and_metadata(self, model):
        """The model's own state dict, and what each shard's header carries: the layout record
        (checkpoint_checks) and every tensor's SHA-256 (checksums), both checked at load."""
        state_dict = model.state_dict()
        digests = tensor_digests(compat.state_dict_values(model, state_dict))  # offloaded tensors read from their hooks
        return state_dict, {**layout_metadata(model, self.quantization_config), **digests}

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        """Compiled steps are row-stable: every reduction is an op of ours (W8A8 GEMMs, attention, lm_head)
        or a per-row norm, so compiled `quasar=True` gives the tokens of compiled plain greedy decoding
        with the same CompileConfig (tests/test_static_steps.py); compiled need not equal eager."""
        return True


def say_quasar_is_the_default(model: torch.nn.Module) -> None:
    """generation_config.quasar = True unless the checkpoint says otherwise: saved with the model, so every
    caller of generate (pipelines, `transformers serve`) decodes with Quasar (speculative/defaults.py)."""
    config = getattr(model, "generation_config", None)
    if config is not None and getattr(config, DEFAULT_FIELD, None) is None:
        compat.set_generation_field(config, DEFAULT_FIELD, True)


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
