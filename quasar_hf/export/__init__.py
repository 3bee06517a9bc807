"""Exports of Quasar W8A8 verifiers to serving-engine layouts."""

from quasar_hf.export.compressed_tensors import ExportReport, export_compressed_tensors

__all__ = ["ExportReport", "export_compressed_tensors"]
