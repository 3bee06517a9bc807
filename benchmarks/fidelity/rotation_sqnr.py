"""Where rotation pays: act-only SQNR of down_proj and o_proj inputs under SmoothQuant, Hadamard rotation, or both.

    python -m benchmarks rotation-sqnr --model smollm2 qwen gemma --name rotation_sqnr

On held-out tokens the BF16 model runs once; each down_proj and o_proj input X [T, K] is captured,
and the linear's output is compared with X W^T after per-token INT8 quantization of its input
(weights kept in float, so only the activation error shows):
  none        quantize X;
  smooth      X diag(s)^-1 against W diag(s), s = max|X|^a / max|W|^(1-a), the best a of ALPHAS per layer;
  rotate      X Q against W Q, Q the full-width Hadamard rotation (what RotatedW8A8Linear does);
  head-rotate o_proj only: Q per attention head (the rotation v_proj/o_proj could absorb offline);
  smooth+rotate  smoothing, then rotation (best a per layer).
SQNR = -10 log10(||Y_hat - Y||^2 / ||Y||^2), pooled over layers ("worst" = the worst layer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks import reports_dir
from benchmarks.fidelity.variants import resolve_model
from quasar_hf.bench.report import environment, write_json_and_markdown
from quasar_hf.ops.hadamard import HadamardRotation, rotate_rows_reference
from quasar_hf.ops.reference import quantize_per_token
from quasar_hf.smoothquant.builtin_text import python_docs_texts
from quasar_hf.smoothquant.data import build_calibration_blocks

ALPHAS = (0.3, 0.5, 0.7)
KINDS = ("down_proj", "o_proj")


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_per_token(x)
    return q.float() * scale


@torch.no_grad()
def capture_inputs(model: torch.nn.Module, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inputs [T, K] (fp32) of every down_proj and o_proj over the blocks."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if name.endswith(tuple("." + k for k in KINDS)):

            def hook(_m, args, name=name):
                seen.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1]).float())

            handles.append(module.register_forward_pre_hook(hook))
    for block in blocks:
        model(input_ids=block[None], use_cache=False)
    for handle in handles:
        handle.remove()
    return {name: torch.cat(parts) for name, parts in seen.items()}


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y - reference).pow(2).sum() / reference.pow(2).sum().clamp_min(1e-30))


def treatments(x: torch.Tensor, weight: torch.Tensor, head_dim: int, kind: str) -> dict[str, float]:
    """Relative output error of each treatment of one linear (see the module docstring)."""
    reference = x @ weight.T
    a, w = x.abs().amax(0).clamp_min(1e-5), weight.abs().amax(0).clamp_min(1e-5)
    full = HadamardRotation.for_size(x.shape[1])

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return rotate_rows_reference(t, full)

    def smoothed(alpha: float) -> torch.Tensor:
        return a.pow(alpha) / w.pow(1 - alpha)

    out = {
        "none": relative_error(fake_quant(x) @ weight.T, reference),
        "smooth": min(relative_error(fake_quant(x / s) @ (weight * s).T, reference) for s in map(smoothed, ALPHAS)),
        "rotate": relative_error(fake_quant(rotate(x)) @ rotate(weight).T, reference),
        "smooth+rotate": min(
            relative_error(fake_quant(rotate(x / s)) @ rotate(weight * s).T, reference) for s in map(smoothed, ALPHAS)
        ),
    }
    if kind == "o_proj":
        head = HadamardRotation.for_size(head_dim)

        def per_head(t: torch.Tensor) -> torch.Tensor:
            return rotate_rows_reference(t.reshape(*t.shape[:-1], -1, head_dim), head).reshape(t.shape)

        out["head-rotate"] = relative_error(fake_quant(per_head(x)) @ per_head(weight).T, reference)
    return out


def measure(model_name: str, blocks_count: int, seq_len: int) -> dict:
    path = resolve_model(model_name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    blocks = build_calibration_blocks(python_docs_texts("heldout"), tokenizer, blocks_count, seq_len, seed=2)
    errors: dict[str, dict[str, list[float]]] = {}
    for name, x in capture_inputs(model, blocks).items():
        kind = name.rsplit(".", 1)[-1]
        weight = model.get_submodule(name).weight.float()
        for treatment, error in treatments(x, weight, head_dim, kind).items():
            errors.setdefault(kind, {}).setdefault(treatment, []).append(error)
    summary = {
        kind: {
            t: {"sqnr_db": -10 * math.log10(sum(v) / len(v)), "worst_layer_sqnr_db": -10 * math.log10(max(v))}
            for t, v in per.items()
        }
        for kind, per in errors.items()
    }
    return {"model": os.path.basename(os.path.normpath(path)), "tokens": int(blocks.numel()), "summary": summary}


def to_markdown(report: dict) -> str:
    treatments_order = ("none", "smooth", "rotate", "head-rotate", "smooth+rotate")
    lines = [
        "# Act-only SQNR of down_proj and o_proj inputs: smoothing vs Hadamard rotation",
        "",
        f"Command: `{report['command']}`. Environment: {json.dumps(report['environment'].get('cpu'))}, "
        f"commit {report['environment'].get('git_commit')}.",
        "",
        __doc__.split("\n\n", 2)[2].strip(),
        "",
        "| model | linear | held-out tokens | " + " | ".join(f"{t} dB (worst)" for t in treatments_order) + " |",
        "|---|---|---|" + "---|" * len(treatments_order),
    ]
    for run in report["runs"]:
        for kind, per in run["summary"].items():
            cells = [
                f"{per[t]['sqnr_db']:.1f} ({per[t]['worst_layer_sqnr_db']:.1f})" if t in per else "-" for t in treatments_order
            ]
            lines.append(f"| {run['model']} | {kind} | {run['tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", nargs="+", default=["smollm2"], help="checkpoint folders or aliases: smollm2, qwen, gemma")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", default=reports_dir("rotation-sqnr"))
    parser.add_argument("--name", required=True)
    args = parser.parse_args(argv)
    report = {
        "command": "python -m benchmarks rotation-sqnr " + " ".join(sys.argv[1:] if argv is None else argv),
        "runs": [measure(m, args.blocks, args.seq_len) for m in args.model],
        "environment": environment(),
    }
    return write_json_and_markdown(report, args.out, args.name, to_markdown)


if __name__ == "__main__":
    for written in main():
        print(written)
