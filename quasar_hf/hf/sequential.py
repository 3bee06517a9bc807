"""Calibrate, smooth and quantize one decoder layer at a time (bounded memory).

The calibration batch's inputs to layer 0 are captured once; then for each layer i: its linears'
input statistics are collected on the current hidden states, the layer is smoothed and its
linears swapped for W8A8 copies (the float weights are dropped as soon as the copies exist), and
the hidden states for layer i+1 are produced by the float layer i (default) or by the quantized
layer i (`layer_inputs="quantized"`, GPTQ-style). Peak memory is
the model plus one layer's fp32 working copies and the calibration batch's hidden states.

Each layer computes on the device `placement.py` chooses for it (`QuasarConfig(calibration_device=...)`:
a GPU when torch sees one, unless told "cpu") and goes back to its home after its turn.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from quasar_hf.architectures import ARCHITECTURES
from quasar_hf.hf.config import QuasarConfig
from quasar_hf.hf.resume_state import ResumeState
from quasar_hf.nn import RotatedW8A8Linear, W8A8Linear, rotate_weight
from quasar_hf.ops.hadamard import HadamardRotation
from quasar_hf.smoothquant.calibration import (
    CalibrationStats,
    LayerCall,
    capture_layer_inputs,
    recording_linear_inputs,
    run_layer,
)
from quasar_hf.smoothquant.gptq import gptq_round, rotated_hessian, smoothed_hessian
from quasar_hf.smoothquant.keep_float import KeepFloatSelector
from quasar_hf.smoothquant.layer_search import RunBlocks, search_alphas_on_layer_output
from quasar_hf.smoothquant.linear_error import column_row_factors
from quasar_hf.smoothquant.mappings import ArchitectureMappings, SmoothMapping, decoder_layers
from quasar_hf.smoothquant.math_dtype import activations_rounded_to, calibration_dtype, cast_layer, restore_dtypes
from quasar_hf.smoothquant.phase_times import PhaseTimes
from quasar_hf.smoothquant.placement import place_layers, stats_to_compute
from quasar_hf.smoothquant.smoothing import smooth_mapping

# Which activations feed layer i+1 during calibration: "quantized" (layer i after W8A8) or
# "float" (layer i before smoothing). "float" measured a slightly lower held-out perplexity and a
# lower peak RSS on SmolLM2-135M (benchmarks/reports/fidelity/sequential_calibration_cpu.md).
LAYER_INPUTS = ("quantized", "float")
DEFAULT_LAYER_INPUTS = "float"


@dataclass
class SequentialResult:
    prescales: dict[str, torch.Tensor] = field(default_factory=dict)  # full name -> 1/s [in]
    alphas: dict[str, float] = field(default_factory=dict)  # "layer.smooth" -> alpha
    rotated: list[str] = field(default_factory=list)  # full names of the RotatedW8A8Linears
    math_dtype: str = ""  # what calibration computed in (math_dtype.calibration_dtype)
    math_dtype_reason: str = ""
    compute_device: str = ""  # where the layers were calibrated ("cuda:0", "cpu", or several, comma-separated)


def cast_layer_calls(calls: list[list[LayerCall]], dtype: torch.dtype) -> list[list[LayerCall]]:
    """Every layer call's floating tensors (masks, rotary embeddings) in `dtype`; a tensor that several
    calls share is cast once and stays shared."""
    cast: dict[int, torch.Tensor] = {}

    def one(obj):
        if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.dtype != dtype:
            if id(obj) not in cast:
                cast[id(obj)] = (obj, obj.to(dtype))  # holding obj: its id cannot be reused meanwhile
            return cast[id(obj)][1]
        if isinstance(obj, (tuple, list)):
            return type(obj)(one(o) for o in obj)
        if isinstance(obj, dict):
            return {k: one(v) for k, v in obj.items()}
        return obj

    return [[LayerCall(one(call.args), one(call.kwargs)) for call in block] for block in calls]


def w8a8_biases_to(layer: nn.Module, dtype: torch.dtype) -> None:
    """W8A8 biases in the model's dtype (what a reload's skeleton holds); their scales stay fp32."""
    for module in layer.modules():
        if isinstance(module, W8A8Linear) and module.bias is not None and module.bias.dtype != dtype:
            module.bias = module.bias.to(dtype)


def active_mappings(arch: ArchitectureMappings, quantized: set[str], rotated: set[str] = frozenset()) -> list[SmoothMapping]:
    """The mappings that apply when only `quantized` (paths inside a layer) become W8A8: every balance
    linear quantized, and a smooth linear too (folding 1/s into a high-precision linear changes it);
    none into a `rotated` linear (rotation replaces smoothing on its input)."""
    return [
        m
        for m in arch.mappings
        if all(b in quantized and b not in rotated for b in m.balance) and (m.kind == "norm" or m.smooth in quantized)
    ]


def rotated_paths(names: list[str], rotate: list[str], rotatable: tuple[str, ...] | None = None) -> set[str]:
    """The paths among `names` (inside one layer) whose last component `rotate` lists ("down_proj", ...),
    limited to the architecture spec's `rotatable` paths when the model has a spec."""
    return {name for name in names if name.rsplit(".", 1)[-1] in rotate and (rotatable is None or name in rotatable)}


def smooth_layer(
    layer: nn.Module,
    index: int,
    names: list[str],
    stats: CalibrationStats,
    arch: ArchitectureMappings,
    config: QuasarConfig,
    layer_output: tuple[RunBlocks, list[torch.Tensor]] | None = None,
    rotated: set[str] = frozenset(),
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
    """Smooth one decoder layer in place; the float function is unchanged.

    `names` and the keys of `stats` are paths inside the layer. Returns (float_weights: path ->
    smoothed fp32 weight [out, in], prescales: path -> [in], alphas: "index.smooth" -> alpha).
    Norm weights (and folded biases) are updated in the layer; linear weights are returned in
    fp32 so quantization starts from the exact smoothed values. With alpha="auto" and
    alpha_search="layer", `layer_output` = (run the layer on some blocks, the float outputs).
    `rotated`: the paths that will become RotatedW8A8Linears (pass the same set to swap_in_w8a8): no
    mapping smooths into them.
    """
    float_weights = {name: layer.get_submodule(name).weight.detach().float().clone() for name in names}
    mappings = active_mappings(arch, set(float_weights), rotated)

    def stats_for(mapping: SmoothMapping) -> tuple[torch.Tensor, torch.Tensor]:
        first = stats.by_module[mapping.balance[0]]
        return first.absmax, first.samples

    chosen: dict[str, float | str] = {m.smooth: config.alpha for m in mappings}
    if config.alpha == "auto" and config.alpha_search == "layer" and mappings:
        if layer_output is None:
            raise ValueError("alpha_search='layer' needs the layer's calibration blocks and float outputs")
        run, references = layer_output
        found, _ = search_alphas_on_layer_output(
            layer, mappings, stats_for, float_weights, config.alpha_grid, run, references, config.backend
        )
        chosen.update(found)
    prescales: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for mapping in mappings:
        absmax, samples = stats_for(mapping)
        result = smooth_mapping(layer, mapping, absmax, samples, chosen[mapping.smooth], config.alpha_grid, float_weights)
        alphas[f"{index}.{mapping.smooth}"] = result.alpha
        prescales.update(result.prescale)
    return float_weights, prescales, alphas


def swap_in_w8a8(
    root: nn.Module,
    float_weights: dict,
    prescales: dict,
    backend: str,
    stats: CalibrationStats | None = None,
    rotated: set[str] = frozenset(),
    times: PhaseTimes | None = None,
) -> None:
    """Replace each named nn.Linear under `root` by a W8A8Linear quantized from its (smoothed) fp32 weight
    (a RotatedW8A8Linear from W Q for the `rotated` names): nearest rounding, or GPTQ rounding when
    `stats` carries input Hessians (weight_rounding="gptq"; a rotated input's Hessian is Q^T H Q).

    Linears that read one input (q/k/v, gate/up) share its Hessian, so GPTQ rounds them as one weight
    [sum N, K]: one damped inverse, one pass over the K columns. Smoothing scales their columns by the
    same factors, and GPTQ does not change when H is scaled by a constant, so this is the rounding each
    would get alone; only the float sums' order differs."""
    times = times or PhaseTimes()
    for group in _rounding_groups(list(float_weights), stats, rotated):
        rounded = dict.fromkeys(group)
        hessian = _group_hessian(root, group, float_weights, stats, rotated, times)
        rotation = HadamardRotation.for_size(float_weights[group[0]].shape[1]) if group[0] in rotated else None
        if rotation is not None:
            with times.phase("rotation"):
                for name in group:
                    float_weights[name] = rotate_weight(float_weights[name], rotation).float()
        if hessian is not None:
            with times.phase("gptq_rounding"):
                ints, scales = gptq_round(torch.cat([float_weights[n] for n in group]), hessian, consume=True)
                del hessian
                bounds = torch.tensor([0] + [float_weights[n].shape[0] for n in group]).cumsum(0).tolist()
                rounded = {n: (ints[a:b], scales[a:b]) for n, a, b in zip(group, bounds[:-1], bounds[1:])}
        with times.phase("swap_in"):
            for name in group:
                linear = root.get_submodule(name)
                weight = float_weights.pop(name)  # drop the fp32 copy as soon as its int8 copy exists
                cls = RotatedW8A8Linear if rotation is not None else W8A8Linear
                module = cls.from_weight(weight, linear.bias, prescales.get(name), backend=backend, rounded=rounded[name])
                root.set_submodule(name, module)
                del weight, linear


def _rounding_groups(names: list[str], stats: CalibrationStats | None, rotated: set[str]) -> list[list[str]]:
    """The linears rounded together: those sharing one Hessian (and rotated alike), in `names` order."""
    groups: dict[tuple, list[str]] = {}
    for name in names:
        entry = stats.by_module.get(name) if stats is not None else None
        shares = entry is not None and (entry.hessian is not None or entry.hessian_owner is not None)
        owner = (entry.hessian_owner or name) if shares else name
        groups.setdefault((owner if shares else f"alone:{name}", name in rotated), []).append(name)
    return list(groups.values())


def _group_hessian(
    root: nn.Module, group: list[str], float_weights: dict, stats: CalibrationStats | None, rotated: set[str], times: PhaseTimes
) -> torch.Tensor | None:
    """The group's input Hessian as its (smoothed, rotated) linears see it, or None (nearest rounding)."""
    entry = stats.by_module.get(group[0]) if stats is not None else None
    if entry is None:
        return None
    owner = stats.by_module.get(entry.hessian_owner) if entry.hessian_owner else entry
    if owner is None or owner.hessian is None:
        return None
    with times.phase("hessian_transform"):
        first = group[0]
        column, _ = column_row_factors(root.get_submodule(first).weight.detach().float(), float_weights[first])
        hessian = smoothed_hessian(owner.hessian, column)  # the smoothed input x / column
        owner.hessian = None  # every reader of this input is in this group: free it now
        if first in rotated:
            hessian = rotated_hessian(hessian, HadamardRotation.for_size(hessian.shape[0]))
    return hessian


@torch.no_grad()
def quantize_layers_sequentially(
    model: nn.Module,
    arch: ArchitectureMappings,
    names: list[str],
    blocks: torch.Tensor,
    config: QuasarConfig,
    layer_inputs: str = DEFAULT_LAYER_INPUTS,
    progress: bool = True,
    keep: KeepFloatSelector | None = None,
    times: PhaseTimes | None = None,
    resume: ResumeState | None = None,
    device: str | torch.device | None = None,
) -> SequentialResult:
    """Calibrate, smooth and W8A8-quantize the named linears (full names) one decoder layer at a time.

    `keep` (QuasarConfig(keep_float=...)) is offered every linear after smoothing and before its
    swap, while the original and the smoothed weights both exist; the caller applies its choice.
    Each layer computes in `result.math_dtype` (math_dtype.py: fp32 on a CPU that emulates the
    model's bf16), with every module's inputs and outputs rounded to the model dtype's values (the
    activations deployment sees), and gets its own dtype back after its turn; `times` collects the phases' seconds.
    With `resume`, each finished layer's state is saved, and a saved state of this same run is
    continued from its next layer (resume_state.py). `device` overrides `config.calibration_device`
    (placement.py decides each layer's compute device from it).
    """
    if layer_inputs not in LAYER_INPUTS:
        raise ValueError(f"layer_inputs must be one of {LAYER_INPUTS}; got {layer_inputs!r}")
    times = times or PhaseTimes()
    layers = decoder_layers(model, arch)
    known = ARCHITECTURES.get(type(model).__name__)
    rotatable = known.rotatable if known is not None else None  # custom mappings: any linear named in `rotate`
    placements = place_layers(layers, config.calibration_device if device is None else device)
    model_dtype = next(layers[0].parameters()).dtype
    math_dtype, reason = calibration_dtype(model_dtype, placements[0].compute, config.calibration_dtype)
    with times.phase("capture_inputs"):
        captured = capture_layer_inputs(model, layers, blocks, progress)
        hidden, captured.hidden = captured.hidden, []  # per block [1, T, H]; only `hidden` keeps them alive
        if math_dtype != model_dtype:
            hidden = [h.to(math_dtype) for h in hidden]
            captured.calls = cast_layer_calls(captured.calls, math_dtype)
    rows_per_block = max(1, config.calibration_sample_rows // len(hidden))
    generator = torch.Generator().manual_seed(config.seed)
    result = SequentialResult(math_dtype=str(math_dtype).replace("torch.", ""), math_dtype_reason=reason)
    result.compute_device = ",".join(sorted({str(p.compute) for p in placements}))
    first = 0
    saved = resume.progress(arch.layers_path, len(layers), names) if resume is not None else None
    if saved is not None:
        with times.phase("resume_restore"):
            first = saved["next_layer"]
            for index in range(first):
                resume.restore_layer(saved, index, layers[index], config.backend, model_dtype)
            hidden = resume.restore_run(saved, generator)
            gathered = saved["gathered"]
            result.alphas, result.rotated = dict(gathered["alphas"]), list(gathered["rotated"])
            result.prescales = {name: model.get_submodule(name).act_prescale for name in gathered["prescaled"]}
    desc = "Quasar layer-by-layer calibration" + (" + alpha search" if config.alpha == "auto" else "")
    bar = tqdm(range(first, len(layers)), desc=desc, disable=not progress, unit="layer", initial=first, total=len(layers))
    for index in bar:
        layer = layers[index]
        times.start_layer()
        prefix = f"{arch.layers_path}.{index}."
        local = [name[len(prefix) :] for name in names if name.startswith(prefix)]
        placement = placements[index]
        device = placement.compute
        placement.enter(layer)
        restore = cast_layer(layer, math_dtype)
        with activations_rounded_to(layer, model_dtype) if math_dtype != model_dtype else contextlib.nullcontext():
            stats = CalibrationStats(num_blocks=len(hidden), seq_len=int(blocks.shape[1]))
            outputs = []
            gptq = config.weight_rounding == "gptq"
            with (
                times.phase("statistics_forward"),
                recording_linear_inputs(layer, local, stats, rows_per_block, generator, hessians=gptq),
            ):
                for block_hidden, calls in zip(hidden, captured.calls):
                    out = run_layer(layer, block_hidden, calls[index], device)
                    if layer_inputs == "float":
                        outputs.append(out)
            stats_to_compute(stats, device)
            layer_output = None
            if config.alpha == "auto" and config.alpha_search == "layer":
                few = list(zip(hidden, captured.calls))[: config.alpha_search_blocks]

                def run(module: nn.Module, few=few, index=index, device=device) -> list[torch.Tensor]:
                    return [run_layer(module, h, calls[index], device) for h, calls in few]

                layer_output = (run, outputs[: len(few)] if layer_inputs == "float" else run(layer))
            rotated = rotated_paths(local, config.rotate, rotatable)
            with times.phase("smoothing_alpha_search"):
                float_weights, prescales, alphas = smooth_layer(layer, index, local, stats, arch, config, layer_output, rotated)
            if keep is not None:
                with times.phase("keep_float_offers"):
                    for name, weight in float_weights.items():
                        module = layer.get_submodule(name)
                        rotation = HadamardRotation.for_size(weight.shape[1]) if name in rotated else None
                        keep.offer(
                            prefix + name,
                            stats.by_module[name].samples,
                            module.weight.to(model_dtype),  # exact: the model's values, in its dtype
                            weight,
                            None if module.bias is None else module.bias.to(model_dtype),
                            prescales.get(name),
                            rotation,
                            placement.home,
                        )
            swap_in_w8a8(layer, float_weights, prescales, config.backend, stats if gptq else None, rotated, times)
            del stats
            if layer_inputs == "quantized":
                with times.phase("next_layer_inputs"):
                    outputs = [run_layer(layer, h, calls[index], device) for h, calls in zip(hidden, captured.calls)]
            hidden = outputs
        restore_dtypes(restore)
        w8a8_biases_to(layer, model_dtype)
        placement.leave(layer)
        result.prescales.update({prefix + p: placement.to_home(v) for p, v in prescales.items()})
        result.alphas.update(alphas)
        result.rotated.extend(prefix + p for p in sorted(rotated))
        if resume is not None:
            with times.phase("resume_save"):
                gathered = {"alphas": result.alphas, "rotated": result.rotated, "prescaled": sorted(result.prescales)}
                resume.save_layer(index, layer, hidden, generator, gathered)
        bar.set_postfix_str(times.postfix(), refresh=False)
    return result
