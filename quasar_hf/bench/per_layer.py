"""Per-layer W8A8 error: for each decoder linear, how far its W8A8 output is from the float linear's.

On held-out tokens, each W8A8Linear's input is captured in the quantized model (so the inputs
carry the upstream quantization error, as in deployment) and compared with the float original's
linear applied to the same input, unsmoothed. The smoothing bookkeeping, per linear:
  x_s   the W8A8 module's input (smoothed: the preceding norm or linear was divided by s);
  p     its act_prescale (1/s where s could not be folded), else 1;
  f     the folded factor, so the original input is x = x_s * f:
        norm -> linears: f = float_norm(z) / quantized_norm(z) per channel (any elementwise norm);
        linear -> linear (v->o, up->down): f = the producer's row factor r (expanded over query
        heads under GQA), read back exactly from its int8 row scales: per-row quantization does
        not depend on r, so r[n] = max_k |W[n, k] c[k]| / (127 * weight_scale[n]);
  c = f / p and r: x_eff = x_s * p = x / c, W_eff = diag(1/r) W diag(c), x_eff @ W_eff.T = x @ W.T / r.
A RotatedW8A8Linear quantizes x_eff Q against W_eff Q (Q its Hadamard rotation), so its errors are
measured in the rotated coordinates, which leave the outputs unchanged.
`quasar_hf.smoothquant.linear_error.add_output_errors` then splits the error into weight-only,
activation-only and both, in the original output coordinates. A reconstruction check (the int8
weights must round W_eff to within about half a step) catches a float model that is not the
quantized one's original.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from quasar_hf.hf.fusion import projections_apart
from quasar_hf.nn import NormFoldedW8A8Linear, RotatedW8A8Linear, W8A8Linear
from quasar_hf.ops.hadamard import HadamardRotation, rotate_rows_float64
from quasar_hf.smoothquant.linear_error import add_output_errors, new_error_sums, summarize
from quasar_hf.smoothquant.mappings import ArchitectureMappings, decoder_layers

MAX_STEP_RESIDUAL = 1.5  # int8 steps; exact smoothing gives <= 0.5, bf16-rounded folds add <= ~0.5
# GPTQ rounding moves weights by a few steps on purpose (errors spread over later columns)
MAX_STEP_RESIDUAL_GPTQ = 16.0


@dataclass
class LinearFrame:
    """How one quantized linear's coordinates relate to the original's (see the module docstring)."""

    column: torch.Tensor  # c [K]: original input = x_eff * c
    row: torch.Tensor  # r [N]: original output = effective output * r
    prescale: torch.Tensor | None  # p [K] or None
    step_residual: float  # max |deq(W_q) - W_eff| in int8 steps of each row
    rotation: HadamardRotation | None = None  # a RotatedW8A8Linear's Q: x_eff and W_eff are rotated

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of t [..., K] in the coordinates the int8 linear computes in (x Q, or x without rotation)."""
        return t if self.rotation is None else rotate_rows_float64(t, self.rotation).float()


def _norm_factor(float_norm: nn.Module, quantized_norm: nn.Module, width: int) -> torch.Tensor:
    """f [K] with float_norm(z) = quantized_norm(z) * f, measured on fixed probes in fp64."""
    generator = torch.Generator().manual_seed(0)
    probes = torch.randn(4, width, generator=generator, dtype=torch.float64) + 2.0  # [4, K]
    a = copy.deepcopy(float_norm).double()(probes)
    b = copy.deepcopy(quantized_norm).double()(probes)
    best = b.abs().argmax(dim=0)  # the probe with the clearest signal per channel
    a, b = a.gather(0, best[None])[0], b.gather(0, best[None])[0]
    return torch.where(b != 0, a / b, torch.ones_like(a)).float()


def _expand_rows(rows: torch.Tensor, width: int, attention: nn.Module | None) -> torch.Tensor:
    """Producer row factors [R] -> consumer column factors [width] (GQA: query heads share a KV head)."""
    if rows.numel() == width:
        return rows
    head_dim = getattr(attention, "head_dim", None)
    if not head_dim or rows.numel() % head_dim or width % rows.numel():
        raise ValueError(f"cannot map {rows.numel()} producer rows onto {width} consumer columns")
    kv = rows.numel() // head_dim
    return rows.view(kv, 1, head_dim).expand(kv, width // rows.numel(), head_dim).reshape(-1)


def _row_factor(float_linear: nn.Linear, deployed: nn.Module, column: torch.Tensor) -> torch.Tensor:
    """r [N] of a producer linear whose output rows were divided by r."""
    w = float_linear.weight.float() * column  # [N, K]
    if isinstance(deployed, W8A8Linear):
        scale = deployed.weight_scale.float()
        return torch.where(scale > 0, w.abs().amax(dim=1) / (127.0 * scale), torch.ones_like(scale))
    ratio = w.double() / deployed.weight.double()  # a float (kept) producer: exact ratio
    return torch.nanmedian(torch.where(torch.isfinite(ratio), ratio, torch.nan), dim=1).values.nan_to_num(1.0).float()


@torch.no_grad()
def linear_frames(quantized: nn.Module, reference: nn.Module, arch: ArchitectureMappings) -> dict[str, LinearFrame]:
    """The frame of every W8A8Linear in the decoder layers of `quantized`, against `reference` (its float original).
    `quantized` must have its projections apart (`hf.fusion.projections_apart`; per_layer_errors does it)."""
    if any(isinstance(m, NormFoldedW8A8Linear) for m in quantized.modules()):
        raise ValueError(
            "linear_frames reads single projections, but this model's are fused (NormFoldedW8A8Linear): "
            "call it inside `with quasar_hf.hf.fusion.projections_apart(model):`"
        )
    qconfig = getattr(quantized.config, "quantization_config", None)
    rounding = qconfig.get("weight_rounding") if isinstance(qconfig, dict) else getattr(qconfig, "weight_rounding", None)
    max_residual = MAX_STEP_RESIDUAL_GPTQ if rounding == "gptq" else MAX_STEP_RESIDUAL
    frames: dict[str, LinearFrame] = {}
    for index, (layer_q, layer_f) in enumerate(zip(decoder_layers(quantized, arch), decoder_layers(reference, arch))):
        fold: dict[str, torch.Tensor] = {}
        rows: dict[str, torch.Tensor] = {}

        def column(path: str) -> torch.Tensor:
            module = layer_q.get_submodule(path)
            f = fold.get(path, torch.ones(layer_f.get_submodule(path).in_features))
            p = getattr(module, "act_prescale", None)
            return f if p is None else f / p.float()

        for mapping in arch.mappings:
            if mapping.kind == "norm":
                width = layer_f.get_submodule(mapping.balance[0]).in_features
                f = _norm_factor(layer_f.get_submodule(mapping.smooth), layer_q.get_submodule(mapping.smooth), width)
            else:
                producer = layer_q.get_submodule(mapping.smooth)
                r = _row_factor(layer_f.get_submodule(mapping.smooth), producer, column(mapping.smooth))
                rows[mapping.smooth] = r
                attention = layer_q.get_submodule(mapping.smooth.rsplit(".", 1)[0]) if "." in mapping.smooth else None
                f = _expand_rows(r, layer_f.get_submodule(mapping.balance[0]).in_features, attention)
            for path in mapping.balance:
                fold[path] = f
        for path, module in layer_q.named_modules():
            if not isinstance(module, W8A8Linear):
                continue
            c = column(path)
            r = rows.get(path, torch.ones(module.out_features))
            rotation = module.rotation if isinstance(module, RotatedW8A8Linear) else None
            w_eff = layer_f.get_submodule(path).weight.float() * c / r[:, None]
            if rotation is not None:
                w_eff = rotate_rows_float64(w_eff, rotation).float()
            scale = module.weight_scale.float()
            residual = (module.dequantized_weight() - w_eff).abs().amax(dim=1) / scale.clamp_min(1e-30)
            residual = float(residual[scale > 0].max()) if bool((scale > 0).any()) else 0.0
            name = f"{arch.layers_path}.{index}.{path}"
            if not residual <= max_residual:
                raise ValueError(
                    f"{name}: the int8 weights are {residual:.2f} quantization steps from the reconstructed smoothed float "
                    "weight; the float model is not this W8A8 model's original (use the checkpoint it was quantized from)"
                )
            frames[name] = LinearFrame(c, r, getattr(module, "act_prescale", None), residual, rotation)
    if not frames:
        raise ValueError(f"no W8A8Linear under {arch.layers_path!r}: is this a Quasar W8A8 model?")
    return frames


@torch.no_grad()
def per_layer_errors(
    quantized: nn.Module, reference: nn.Module, windows: list[torch.Tensor], arch: ArchitectureMappings
) -> dict[str, dict]:
    """Error sums per W8A8 linear over token windows [T] fed to the quantized model, each projection of a
    fused group measured apart (hf.fusion.projections_apart: its own input, the norm's rounded output)."""
    with projections_apart(quantized):
        return _per_layer_errors(quantized, reference, windows, arch)


def _per_layer_errors(
    quantized: nn.Module, reference: nn.Module, windows: list[torch.Tensor], arch: ArchitectureMappings
) -> dict[str, dict]:
    frames = linear_frames(quantized, reference, arch)
    sums = {name: new_error_sums() for name in frames}

    def hook_for(name: str, module: W8A8Linear):
        frame, original = frames[name], reference.get_submodule(name)

        def hook(_module: nn.Module, args: tuple) -> None:
            x_s = args[0].reshape(-1, args[0].shape[-1]).float()  # [M, K]
            x_eff = frame.rotate(x_s if frame.prescale is None else x_s * frame.prescale.float())
            w_eff = frame.rotate(original.weight.float() * frame.column / frame.row[:, None])  # [N, K]
            b_eff = None if original.bias is None else original.bias.float() / frame.row
            add_output_errors(sums[name], x_eff, w_eff, module.weight, module.weight_scale, b_eff, module.bias, frame.row)

        return hook

    device = next(quantized.parameters()).device
    handles = [quantized.get_submodule(n).register_forward_pre_hook(hook_for(n, quantized.get_submodule(n))) for n in frames]
    try:
        for window in windows:
            quantized(input_ids=window[None].to(device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {name: {**summarize(s), "step_residual": frames[name].step_residual, "_sums": s} for name, s in sums.items()}


def _kind(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _layer(name: str) -> int:
    return int(name.split(".")[-3]) if name.split(".")[-3].isdigit() else -1


def build_report(errors: dict[str, dict]) -> dict:
    """Rows sorted by W8A8 error (worst first), totals overall and per linear kind (error energy pooled)."""
    rows = [
        {"name": n, "layer": _layer(n), "kind": _kind(n), **{k: v for k, v in e.items() if k != "_sums"}}
        for n, e in errors.items()
    ]
    rows.sort(key=lambda r: -r["both_rel_mse"])

    def pooled(names: list[str]) -> dict:
        total = new_error_sums()
        for n in names:
            for key in total:
                total[key] += errors[n]["_sums"][key]
        return {"linears": len(names), **summarize(total)}

    kinds = sorted({_kind(n) for n in errors})
    return {
        "rows": rows,
        "totals": pooled(list(errors)),
        "by_kind": {k: pooled([n for n in errors if _kind(n) == k]) for k in kinds},
    }


def _db(v: float) -> str:
    return "inf" if math.isinf(v) else f"{v:.1f}"


def report_markdown(result: dict) -> str:
    """The report as markdown: command, environment, totals, per kind, per linear."""
    report, env = result["report"], result.get("environment", {})
    split_head = [
        "SQNR both (dB)",
        "SQNR weight-only (dB)",
        "SQNR act-only (dB)",
        "rel MSE both",
        "rel MSE weight",
        "rel MSE act",
    ]

    order = ("both", "weight", "act")  # the header's order

    def cells(e: dict) -> list[str]:
        return [_db(e[f"{s}_sqnr_db"]) for s in order] + [f"{e[f'{s}_rel_mse']:.2e}" for s in order]

    lines = [f"# Per-layer W8A8 error: {result['model']}", "", "Command:", "", "```", result["command"], "```", ""]
    versions = env.get("versions", {})
    lines += [
        f"Environment: {env.get('cpu')} ({env.get('cpu_count')} CPUs, {env.get('torch_threads')} torch threads), "
        f"GPU {(env.get('cuda') or {}).get('device', 'none')}, torch {versions.get('torch')}, transformers "
        f"{versions.get('transformers')}, load average {env.get('load_average')}, commit {env.get('git_commit')}.",
        "",
        f"Held-out tokens: {result['heldout']}. Quantization: {result['quantization']}.",
        "",
        "Each W8A8 linear's input is captured in the W8A8 model; the reference is the float original's linear on the "
        "same input with the smoothing undone. weight-only = int8 weights x float activations, act-only = per-token "
        "int8 activations x float (smoothed) weights, both = W8A8. SQNR = -10 log10(rel MSE), rel MSE = "
        "||y_hat - y||^2 / ||y||^2 in the original output coordinates. Totals pool error energy over linears.",
        "",
        "## Totals",
        "",
        "| linears | kind | " + " | ".join(split_head) + " |",
        "|" + "---|" * (len(split_head) + 2),
        f"| {report['totals']['linears']} | all | " + " | ".join(cells(report["totals"])) + " |",
    ]
    for kind, e in report["by_kind"].items():
        lines.append(f"| {e['linears']} | {kind} | " + " | ".join(cells(e)) + " |")
    preview = report.get("keep_float_preview")
    if preview:
        lines += [
            "",
            "## keep_float price",
            "",
            f'keep_float="auto" with budget {preview["budget"]} ranked by these held-out errors would keep '
            f"{len(preview['modules'])} linears ({', '.join(preview['modules']) or 'none'}), adding "
            f"{preview['added_bytes'] / 1e6:.2f} MB per verify step to {preview['int8_weight_bytes'] / 1e6:.2f} MB of int8 "
            "decoder weights (quantization ranks by calibration rows instead, so its choice may differ).",
        ]
    lines += ["", "## Per linear (worst first)", "", "| # | linear | " + " | ".join(split_head) + " | recon. residual (steps) |"]
    lines.append("|" + "---|" * (len(split_head) + 3))
    for i, row in enumerate(report["rows"], 1):
        lines.append(f"| {i} | {row['name']} | " + " | ".join(cells(row)) + f" | {row['step_residual']:.2f} |")
    return "\n".join(lines) + "\n"


def evaluate_per_layer(
    quantized: nn.Module,
    reference: nn.Module,
    tokenizer,
    texts: list[str] | None = None,
    seq_len: int = 256,
    max_windows: int | None = 8,
) -> dict:
    """The per-layer report of `quantized` (a Quasar W8A8 model) against `reference` (its float original).

    texts: held-out strings (None: the built-in held-out split, disjoint from the default calibration).
    Returns {"heldout": description, "report": {"rows", "totals", "by_kind"}}.
    """
    from quasar_hf.bench.fidelity import heldout_texts, token_windows
    from quasar_hf.smoothquant.mappings import resolve_mappings

    qconfig = getattr(quantized.config, "quantization_config", None)
    custom = (
        getattr(qconfig, "smoothquant_mappings", None) if not isinstance(qconfig, dict) else qconfig.get("smoothquant_mappings")
    )
    arch = resolve_mappings(reference, custom)
    source = "caller texts"
    if texts is None:
        texts, source = heldout_texts(), "builtin held-out split"
    windows = token_windows(tokenizer, texts, seq_len, max_windows)
    errors = per_layer_errors(quantized, reference, windows, arch)
    report = build_report(errors)
    report["keep_float_preview"] = keep_float_preview(report, reference)
    return {"heldout": f"{len(windows)} windows x {windows[0].numel()} tokens, {source}", "report": report}


def keep_float_preview(report: dict, reference: nn.Module, budget: float = 0.05) -> dict:
    """What keep_float="auto" would keep if it ranked by these held-out errors, and the bytes it adds.

    (Quantization ranks by calibration rows; this shows the price of the default budget.)
    """
    from quasar_hf.smoothquant.keep_float import choose_keep_float, float_bytes, int8_bytes

    weights = {row["name"]: reference.get_submodule(row["name"]).weight for row in report["rows"]}
    added = {n: float_bytes(w, w.dtype) - int8_bytes(w) for n, w in weights.items()}
    int8_total = sum(int8_bytes(w) for w in weights.values())
    chosen = choose_keep_float({r["name"]: r["both_rel_mse"] for r in report["rows"]}, added, int8_total, budget)
    return {
        "budget": budget,
        "modules": chosen,
        "added_bytes": sum(added[n] for n in chosen),
        "int8_weight_bytes": int8_total,
    }
