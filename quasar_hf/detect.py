"""Tell whether a model was quantized by quasar_hf (without importing the quantizer), and which quasar_hf this is."""

from __future__ import annotations

QUANT_METHOD = "quasar"


def is_quasar_model(model: object) -> bool:
    """True when `model.config.quantization_config` says quant_method == "quasar"."""
    config = getattr(model, "config", None)
    qconfig = getattr(config, "quantization_config", None)
    if qconfig is None:
        return False
    method = qconfig.get("quant_method") if isinstance(qconfig, dict) else getattr(qconfig, "quant_method", None)
    return str(getattr(method, "value", method)) == QUANT_METHOD


def plain_decoding(model: object) -> dict:
    """The generate keyword for plain decoding of `model`: {"quasar": False} on a Quasar model (Quasar is
    its default), {} on any other model (whose generate takes no such keyword)."""
    return {"quasar": False} if is_quasar_model(model) else {}


def package_version() -> str:
    """The installed quasar-hf distribution's version, or "source" for a tree run without installing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("quasar-hf")
    except PackageNotFoundError:
        return "source"
