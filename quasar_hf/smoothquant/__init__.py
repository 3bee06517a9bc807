"""SmoothQuant: per-architecture mappings, calibration statistics, factor folding, alpha search."""

from quasar_hf.smoothquant.mappings import SMOOTHQUANT_MAPPINGS, SmoothMapping, resolve_mappings

__all__ = ["SMOOTHQUANT_MAPPINGS", "SmoothMapping", "resolve_mappings"]
