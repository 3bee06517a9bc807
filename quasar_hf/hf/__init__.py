"""Transformers integration: QuasarConfig + QuasarHfQuantizer registered as quant_method "quasar"."""

from __future__ import annotations

from quasar_hf.detect import QUANT_METHOD, is_quasar_model
from quasar_hf.hf.binding import bind_quasar_methods
from quasar_hf.hf.config import QuasarConfig
from quasar_hf.self_draft import register_self_drafter


def register_with_transformers() -> None:
    """Register the config, the quantizer and the saved checkpoints' model type once; harmless to call
    again (Transformers raises on duplicates)."""
    from transformers.quantizers import auto

    from quasar_hf.hf.checkpoint_config import register_checkpoint_config
    from quasar_hf.hf.quantizer import QuasarHfQuantizer

    register_checkpoint_config()
    if QUANT_METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.register_quantization_config(QUANT_METHOD)(QuasarConfig)
    if QUANT_METHOD not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer(QUANT_METHOD)(QuasarHfQuantizer)


__all__ = ["QuasarConfig", "bind_quasar_methods", "is_quasar_model", "register_self_drafter", "register_with_transformers"]
