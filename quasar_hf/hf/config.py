"""QuasarConfig: the quantization config users pass to `from_pretrained`, validated in one place."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from quasar_hf.architectures import ARCHITECTURES
from quasar_hf.ops.dispatch import BACKENDS
from quasar_hf.smoothquant.math_dtype import CALIBRATION_DTYPES
from quasar_hf.smoothquant.placement import validate_calibration_device

QUASAR_FORMAT_VERSION = "1"
DEFAULT_ALPHA_GRID = [round(0.1 * i, 1) for i in range(11)]
_BACKENDS = ("auto", *BACKENDS)  # the W8A8 backend table's rows (ops/dispatch.py)
_DRAFT_DTYPES = ("model", "int8")
_ALPHA_SEARCHES = ("linear", "layer")
_WEIGHT_ROUNDINGS = ("nearest", "gptq")
# Names `rotate` may list: the last components of the architecture specs' rotatable linears (inputs
# no norm produces, where smoothing does least): ("down_proj", "o_proj").
ROTATABLE = tuple(dict.fromkeys(path.rsplit(".", 1)[-1] for spec in ARCHITECTURES.values() for path in spec.rotatable))
# o_proj: +1.6 dB on SmolLM2 but -2.3 dB on Qwen 0.5B (benchmarks/reports/rotation-sqnr/rotation_sqnr.md)
DEFAULT_ROTATE = ["down_proj"]
# Fields that are run-time inputs only (never written to config.json).
_RUNTIME_ONLY = ("tokenizer", "calibration_dataset", "resume_dir", "calibration_device")


# Fields the quantizer writes (read back on reload); users set none of them.
QUANTIZER_RECORDS = ("calibration_info", "searched_alphas", "rotation_info", "draft_info", "keep_float_info", "measured")
QUANTIZER_MODULE_LISTS = ("quantized_modules", "prescaled_modules", "rotated_modules")
WRITTEN_BY_QUANTIZER = (*QUANTIZER_RECORDS, *QUANTIZER_MODULE_LISTS)


@dataclass
class QuasarConfig(QuantizationConfigMixin):
    """W8A8 SmoothQuant quantization for Quasar verification.

    Args:
        bits: weight and activation bits; only 8 is supported.
        alpha: SmoothQuant migration strength in [0, 1], or "auto" (per-mapping search on `alpha_grid`).
        alpha_search: what alpha="auto" minimises: "linear" (each mapping's own linears, on sampled
            rows) or "layer" (the decoder layer's per-token output error on `alpha_search_blocks`
            calibration blocks, mappings chosen in order; slower, see quasar_hf.smoothquant.layer_search).
        calibration_dataset: None (the shipped prose, code and chat text, "builtin:mix-v1"), "builtin:python-docs"
            (Python's documentation alone), a list of strings, a `datasets.Dataset`, a local
            .txt/.json/.jsonl/.parquet/.csv file, or a Hub dataset name.
        num_calibration_samples / calibration_seq_len: how many token blocks of which length.
        weight_rounding: "gptq" (second-order rounding of the smoothed weights on the calibration inputs'
            Hessian: same scales and format, closer to the float model, slower to quantize) or "nearest".
        modules_to_not_convert: module-name suffixes kept in high precision (lm_head by default;
            embeddings and norms are never quantized).
        smoothquant_mappings: custom mappings as data (see `quasar_hf.smoothquant.mappings`).
        backend: W8A8 kernel when quantizing on load: "auto", "torch", "triton", "bitsandbytes", "cpu_fused"
            or "reference" (a saved checkpoint keeps its own: switch it with `quasar_hf.set_backend(model, name)`).
        draft_layers: None (no draft path), decoder-layer indices kept in high precision for the
            self-draft path, or "auto".
        draft_dtype: "model" keeps unquantized copies of the draft layers in the model's dtype (BF16 for a
            BF16 model: the dual-precision model); "int8" reuses the W8A8 verify layers
            (no extra memory).
        draft_budget: for draft_layers="auto", the largest fraction of decoder layers the draft may keep.
        draft_vocab_size: None (the draft uses the full lm_head), or N: a reduced-vocabulary draft head
            of the N tokens most frequent in the calibration text (drafter="self_reduced"); needs draft_layers.
        tokenizer: tokenizer (or its path) for calibration; defaults to the model's own folder.
        resume_dir: a folder where quantization saves its state after every decoder layer; a run
            with the same model and settings that finds a state there continues after its last
            finished layer, with a bit-identical result (not saved in config.json; not with keep_float).
        keep_float: None, "auto" or a list of full linear names kept in the model's float dtype: "auto"
            keeps the decoder linears with the largest W8A8 error on calibration rows, most damaging
            first, while the bytes they add stay within `keep_float_budget`.
        keep_float_budget: the bytes kept linears may add (float minus int8 bytes), as a fraction of all
            int8 weight bytes.
        calibration_dtype: what calibration, the alpha search and GPTQ compute in: "auto" (fp32 on a
            CPU that emulates the model's bf16/fp16, i.e. without AVX512-BF16 or AMX; else the model's
            dtype), "model" or "float32". The saved checkpoint keeps the model's dtype either way.
        calibration_device: where each decoder layer is calibrated, smoothed and rounded: "auto" (the GPU
            a layer lives on; a CPU layer goes to the current CUDA device for its turn when torch sees one),
            "cpu" (stay on the CPU), or a device string like "cuda:1". Run-time only (not in config.json).
        rotate: which decoder linears quantize a Hadamard-rotated input instead of a smoothed one
            (RotatedW8A8Linear): any of "down_proj", "o_proj"; [] for SmoothQuant alone. The rotation
            is online, inside the W8A8 verify path only; the draft path and the shared ends are untouched.
    Written by the quantizer (read back on reload): calibration_info, searched_alphas,
    quantized_modules, prescaled_modules, rotated_modules, rotation_info, draft_info, keep_float_info, measured.
    """

    bits: int = 8
    alpha: float | str = "auto"
    alpha_grid: list[float] = field(default_factory=lambda: list(DEFAULT_ALPHA_GRID))
    alpha_search: str = "linear"
    alpha_search_blocks: int = 4
    weight_rounding: str = "gptq"
    calibration_dataset: Any = None
    calibration_text_column: str | None = None
    calibration_split: str = "train"
    num_calibration_samples: int = 32
    calibration_seq_len: int = 512
    calibration_sample_rows: int = 256
    modules_to_not_convert: list[str] = field(default_factory=lambda: ["lm_head"])
    smoothquant_mappings: dict | None = None
    backend: str = "auto"
    draft_layers: list[int] | str | None = None
    draft_dtype: str = "model"
    draft_budget: float = 0.5
    draft_vocab_size: int | None = None
    seed: int = 0
    calibration_dtype: str = "auto"
    calibration_device: str = "auto"
    keep_float: list[str] | str | None = None
    keep_float_budget: float = 0.05
    rotate: list[str] = field(default_factory=lambda: list(DEFAULT_ROTATE))
    tokenizer: Any = None
    resume_dir: str | None = None
    version: str = QUASAR_FORMAT_VERSION
    calibration_info: dict | None = None
    searched_alphas: dict | None = None
    quantized_modules: list[str] | None = None
    prescaled_modules: list[str] | None = None
    rotated_modules: list[str] | None = None
    rotation_info: dict | None = None
    draft_info: dict | None = None
    keep_float_info: dict | None = None
    measured: dict | None = None
    quant_method: str = "quasar"

    def __post_init__(self) -> None:
        if self.quant_method != "quasar":
            raise ValueError(f"QuasarConfig.quant_method must be 'quasar', got {self.quant_method!r}")
        if self.bits != 8:
            raise ValueError(f"QuasarConfig supports bits=8 only (W8A8); got bits={self.bits!r}")
        if isinstance(self.alpha, str):
            if self.alpha != "auto":
                raise ValueError(f"alpha must be a float in [0, 1] or 'auto'; got {self.alpha!r}")
        elif not isinstance(self.alpha, (int, float)) or not 0.0 <= float(self.alpha) <= 1.0:
            raise ValueError(f"alpha must be a float in [0, 1] or 'auto'; got {self.alpha!r}")
        grid = self.alpha_grid
        if (
            not isinstance(grid, (list, tuple))
            or not grid
            or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and 0.0 <= float(a) <= 1.0 for a in grid)
        ):
            raise ValueError(f"alpha_grid must be a non-empty list of floats in [0, 1], e.g. [0.5, 0.7, 0.85]; got {grid!r}")
        if str(self.version) != QUASAR_FORMAT_VERSION:
            raise ValueError(
                f"version {self.version!r}: this quasar_hf reads Quasar checkpoints of format version "
                f"{QUASAR_FORMAT_VERSION!r}; a newer format needs a newer quasar_hf (`pip install -U quasar-hf`), "
                "an older one must be re-quantized from its original model"
            )
        for name in (*QUANTIZER_RECORDS, "smoothquant_mappings"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{name} must be a dict (written by quasar_hf) or None; got {value!r}")
        for name in QUANTIZER_MODULE_LISTS:
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value)):
                raise ValueError(f"{name} must be a list of module names (written by quasar_hf) or None; got {value!r}")
        if self.weight_rounding not in _WEIGHT_ROUNDINGS:
            raise ValueError(f"weight_rounding must be one of {_WEIGHT_ROUNDINGS}; got {self.weight_rounding!r}")
        if self.alpha_search not in _ALPHA_SEARCHES:
            raise ValueError(f"alpha_search must be one of {_ALPHA_SEARCHES}; got {self.alpha_search!r}")
        for name in ("num_calibration_samples", "calibration_seq_len", "calibration_sample_rows", "alpha_search_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer (it seeds the calibration sampling); got {self.seed!r}")
        if self.calibration_dtype not in CALIBRATION_DTYPES:
            raise ValueError(
                f"calibration_dtype must be one of {list(CALIBRATION_DTYPES)} ('auto': fp32 on a CPU that emulates "
                f"the model's bf16/fp16, else the model's dtype); got {self.calibration_dtype!r}"
            )
        self.calibration_device = validate_calibration_device(self.calibration_device)
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}; got {self.backend!r}")
        if self.draft_dtype not in _DRAFT_DTYPES:
            raise ValueError(f"draft_dtype must be one of {_DRAFT_DTYPES}; got {self.draft_dtype!r}")
        if not isinstance(self.draft_budget, (int, float)) or not 0.0 < float(self.draft_budget) < 1.0:
            raise ValueError(f"draft_budget must be a fraction in (0, 1); got {self.draft_budget!r}")
        if isinstance(self.draft_layers, str) and self.draft_layers != "auto":
            raise ValueError(f"draft_layers must be None, a list of layer indices or 'auto'; got {self.draft_layers!r}")
        if isinstance(self.draft_layers, (list, tuple)):
            if not self.draft_layers or not all(isinstance(i, int) and i >= 0 for i in self.draft_layers):
                raise ValueError(f"draft_layers must be non-negative layer indices; got {self.draft_layers!r}")
            self.draft_layers = sorted(set(self.draft_layers))
        if self.draft_vocab_size is not None:
            size = self.draft_vocab_size
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"draft_vocab_size must be a positive integer or None; got {size!r}")
            if self.draft_layers is None:
                raise ValueError("draft_vocab_size needs a draft path: also pass draft_layers=[...] or 'auto'")
        self._validate_keep_float()
        rotate = self.rotate
        if not isinstance(rotate, (list, tuple)) or not all(isinstance(r, str) for r in rotate):
            raise ValueError(f"rotate must be a list drawn from {list(ROTATABLE)} ([] for none); got {rotate!r}")
        unknown = sorted(set(rotate) - set(ROTATABLE))
        if unknown:
            raise ValueError(
                f"rotate names {unknown}: only the inputs of {list(ROTATABLE)} can be rotated (the others are "
                "produced by a norm, which SmoothQuant folds into); e.g. rotate=['down_proj']"
            )
        self.rotate = [r for r in ROTATABLE if r in rotate]
        if not isinstance(self.modules_to_not_convert, (list, tuple)):
            raise ValueError("modules_to_not_convert must be a list of module-name suffixes")
        self.modules_to_not_convert = list(self.modules_to_not_convert)

    def _validate_keep_float(self) -> None:
        if isinstance(self.keep_float, str):
            if self.keep_float != "auto":
                raise ValueError(f"keep_float must be None, 'auto' or a list of module names; got {self.keep_float!r}")
        elif isinstance(self.keep_float, (list, tuple)):
            if not self.keep_float or not all(isinstance(n, str) and n for n in self.keep_float):
                raise ValueError(
                    "keep_float must be a non-empty list of full module names like 'model.layers.3.mlp.down_proj'; "
                    f"got {self.keep_float!r}"
                )
            self.keep_float = sorted(set(self.keep_float))
        elif self.keep_float is not None:
            raise ValueError(f"keep_float must be None, 'auto' or a list of module names; got {self.keep_float!r}")
        budget = self.keep_float_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 < float(budget) <= 1.0:
            raise ValueError(f"keep_float_budget must be a fraction in (0, 1] of the int8 weight bytes; got {budget!r}")

    # Serialization: only JSON-friendly, reload-relevant fields go to config.json.
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name not in _RUNTIME_ONLY}
        if isinstance(self.calibration_dataset, str):
            out["calibration_dataset"] = self.calibration_dataset
        return out

    def to_diff_dict(self) -> dict[str, Any]:
        return self.to_dict()

    def __iter__(self):
        yield from self.to_dict().items()

    def __repr__(self) -> str:
        return f"QuasarConfig({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items() if k != 'quantized_modules')})"

    @classmethod
    def from_dict(cls, config_dict: dict, return_unused_kwargs: bool = False, **kwargs):
        known = {f.name for f in fields(cls)}
        unknown = set(config_dict) - known
        if unknown:
            raise ValueError(
                f"unknown QuasarConfig fields {sorted(unknown)}: this checkpoint may come from a newer quasar_hf "
                "(upgrade with `pip install -U quasar-hf`)"
            )
        config_dict = dict(config_dict)
        if config_dict.get("quantized_modules") and "weight_rounding" not in config_dict:
            config_dict["weight_rounding"] = "nearest"  # saved before the field existed: rounded to nearest
        if config_dict.get("quantized_modules") and "rotate" not in config_dict:
            config_dict["rotate"] = []  # saved before rotation existed: nothing was rotated
        return super().from_dict(config_dict, return_unused_kwargs=return_unused_kwargs, **kwargs)
