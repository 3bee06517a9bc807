"""`python -m benchmarks per-layer`: the per-layer W8A8 error report (quasar_hf.bench.per_layer) of a
model folder, written as markdown + JSON.

    python -m benchmarks per-layer --name per_layer_smollm2                              # embedded SmolLM2, quantized now
    python -m benchmarks per-layer --model DIR --quantized QDIR --name per_layer_x   # a saved checkpoint
"""

from __future__ import annotations

import math

import torch

from benchmarks import reports_dir
from quasar_hf.bench.per_layer import evaluate_per_layer, report_markdown


def _json_safe(value):
    """Infinite SQNR (an exact split) as null: strict JSON has no Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> list[str]:
    """CLI: per-layer W8A8 error report (markdown + JSON) for any model folder."""
    import argparse
    import json
    import os
    import shlex
    import sys
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quasar_hf import QuasarConfig
    from quasar_hf.bench.report import environment

    parser = argparse.ArgumentParser(prog="python -m benchmarks per-layer", description=main.__doc__)
    parser.add_argument("--model", default=None, help="float checkpoint folder (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--quantized", default=None, help="saved Quasar checkpoint of --model (default: quantize now)")
    parser.add_argument("--alpha", default=None, help="QuasarConfig alpha when quantizing now (default: the default)")
    parser.add_argument("--calibration-samples", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-windows", type=int, default=8)
    parser.add_argument("--out", default=reports_dir("per-layer"))
    parser.add_argument("--name", default="per_layer")
    args = parser.parse_args(argv)
    command = "python -m benchmarks per-layer " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))

    model_path = args.model
    if model_path is None:
        from quasar_hf.models import smollm2_135m_instruct

        model_path = smollm2_135m_instruct()
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    started = time.perf_counter()
    if args.quantized:
        quantized = AutoModelForCausalLM.from_pretrained(args.quantized, dtype=dtype).eval()
    else:
        options = {}
        if args.alpha is not None:
            options["alpha"] = args.alpha if args.alpha == "auto" else float(args.alpha)
        if args.calibration_samples is not None:
            options["num_calibration_samples"] = args.calibration_samples
        quantized = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, quantization_config=QuasarConfig(**options)
        ).eval()
    quantize_s = time.perf_counter() - started
    qconfig = quantized.config.quantization_config
    qdict = qconfig if isinstance(qconfig, dict) else qconfig.to_dict()
    result = {
        "command": command,
        "model": os.path.basename(os.path.normpath(str(model_path))),
        "model_path": str(model_path),
        "quantization": (
            f"{args.quantized or 'quantized at run time'} (alpha {qdict.get('alpha')}, calibration "
            f"{(qdict.get('calibration_info') or {}).get('num_samples')} x {(qdict.get('calibration_info') or {}).get('seq_len')} "
            f"tokens, keep_float {(qdict.get('keep_float_info') or {}).get('modules')}), load/quantize {quantize_s:.0f} s"
        ),
        "dtype": args.dtype,
        **evaluate_per_layer(quantized, reference, tokenizer, None, args.seq_len, args.max_windows),
        "environment": environment(),
    }
    os.makedirs(args.out, exist_ok=True)
    json_path, md_path = (os.path.join(args.out, f"{args.name}.{ext}") for ext in ("json", "md"))
    with open(json_path, "w") as fh:
        json.dump(_json_safe(result), fh, indent=1, default=str)
    with open(md_path, "w") as fh:
        fh.write(report_markdown(result))
    return [json_path, md_path]
