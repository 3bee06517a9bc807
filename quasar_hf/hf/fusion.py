"""Fuse at load, split when saving: each RMSNorm and the W8A8 projections it feeds become one
NormFoldedW8A8Linear (nn/norm_folded_linear.py), with checkpoint names unchanged.

`fuse_projections(model)` runs once a Quasar model is loaded or quantized. For each fold group of the
architecture spec (a norm and the linears it feeds: q/k/v, gate/up; Phi-3's qkv_proj alone) whose
members are all plain W8A8Linears on one device with no act_prescale and alike biases, it stacks the
members' int8 weights, scales and biases into one W8A8Linear, puts a NormFoldedW8A8Linear where the
norm was and a FusedProjectionSlice where each member was. The groups are the spec's `fold_groups`,
declared per architecture (architectures.py) with the rule they rest on: the layer forward passes the
norm's output to those projections and to nothing else. hf/fold_check.py confirms it by tracing one
forward per model class; a group that breaks it stays unfused. Custom SmoothQuant mappings change
nothing here. Groups that do not qualify, layers that Accelerate dispatches, and
model classes without an architecture spec (whose layer forward quasar_hf does not know) stay
unfused: their norms run alone and each projection quantizes the norm's rounded output.

The decoder layer gets two torch state-dict hooks (an extension point of every nn.Module): saving
splits each stacked tensor back into the members' `weight` / `weight_scale` / `bias`, and loading
stacks them, so `state_dict()`, `load_state_dict`, `save_pretrained`, resume and export see exactly
the names and values of the unfused model.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from quasar_hf import compat
from quasar_hf.architectures import UnknownArchitectureError, spec_for
from quasar_hf.hf.fold_check import groups_breaking_the_rule
from quasar_hf.nn.norm_folded_linear import FusedProjectionSlice, NormFoldedW8A8Linear, rmsnorm_epsilon
from quasar_hf.nn.rowstable_norm import RowStableRMSNorm
from quasar_hf.nn.w8a8_linear import W8A8Linear, check_int8_weight
from quasar_hf.smoothquant.mappings import decoder_layers_at

logger = logging.getLogger(__name__)

STACKED = ("weight", "weight_scale", "bias")  # the W8A8Linear tensors stacked along output rows
HOOKED = "quasar_fusion_hooks"  # set on a decoder layer that holds the two hooks (they do nothing once unfused)


def fuse_projections(model: nn.Module, log: bool = True) -> int:
    """Fuse every qualifying fold group of `model` (see the module docstring); returns how many. With `log`,
    one line at info level says how many groups fused out of how many, and the first reason for a skip."""
    try:
        spec = spec_for(model)
    except UnknownArchitectureError:
        if log:
            logger.info("quasar_hf: no norm + projection group fused: %s has no architecture spec", type(model).__name__)
        return 0
    layers = decoder_layers_at(model, spec.layers_path)
    broken = groups_breaking_the_rule(model, layers[0], spec.fold_groups) if len(layers) else {}
    fused, total, first_skip = 0, 0, None
    for index, layer in enumerate(layers):
        layer_fused = 0
        for group in spec.fold_groups:
            total += 1
            reason = broken.get(group.norm) or _fuse_group(layer, group.norm, group.projections)
            layer_fused += reason is None
            first_skip = first_skip or (None if reason is None else f"layer {index} {group.norm}: {reason}")
        if layer_fused and not getattr(layer, HOOKED, False):  # once per layer: a layer fused again keeps them
            layer.register_state_dict_post_hook(split_fused_state)
            layer.register_load_state_dict_pre_hook(stack_fused_state)
            setattr(layer, HOOKED, True)
        fused += layer_fused
    if log:
        logger.info(
            "quasar_hf: fused %d of %d norm + projection groups%s",
            fused,
            total,
            f"; first not fused: {first_skip}" if first_skip else "",
        )
    return fused


def _fuse_group(layer: nn.Module, norm_path: str, member_paths: tuple[str, ...]) -> str | None:
    """Fuse one group of one layer; None when it fused, else why it stays as it is."""
    if compat.has_accelerate_hook(layer):
        return "Accelerate dispatches this layer (device_map): its hooks own the modules' forward"
    if "." in norm_path:  # the fused module's members are named from the layer it is a child of
        return "the norm is not a direct child of the decoder layer"
    try:
        norm = layer.get_submodule(norm_path)
        members = [layer.get_submodule(path) for path in member_paths]
    except AttributeError:
        return "the layer has no such modules (shaped unlike the spec)"
    reason = _why_not_fusable(norm, members)
    if reason is not None:
        return reason
    stacked = _stack(members)
    columns, start = [], 0
    for path, member in zip(member_paths, members):
        columns.append((path, start, start + member.out_features))
        start += member.out_features
    fused = NormFoldedW8A8Linear(norm, stacked, columns)
    layer.set_submodule(norm_path, fused)
    for path, first, stop in columns:
        layer.set_submodule(path, FusedProjectionSlice(first, stop, start, norm_path, stacked.in_features))
    return None


def _why_not_fusable(norm: nn.Module, members: list[nn.Module]) -> str | None:
    """None for members that stack into one linear the fold computes exactly as each alone (a
    RotatedW8A8Linear quantizes x Q, not the norm's output; an act_prescale would be replaced by the
    fold's scale), else why not."""
    if rmsnorm_epsilon(norm) is None:
        return f"{type(norm).__name__} is not an RMSNorm class quasar_hf knows"
    if compat.has_accelerate_hook(norm) or any(compat.has_accelerate_hook(m) for m in members):
        return "Accelerate dispatches a member (device_map)"
    if not members or not all(type(m) is W8A8Linear for m in members):
        return "a member is not a plain W8A8 linear (kept in float, rotated, or already fused)"
    if any(m.act_prescale is not None for m in members):
        return "a member keeps an unfolded SmoothQuant prescale"
    first = members[0]
    if any(m.weight.device != first.weight.device or norm.weight.device != first.weight.device for m in members):
        return "the norm and its members are on different devices"
    if first.weight.device == torch.device("meta"):
        return "the members are offloaded (on the meta device)"
    if any(m.in_features != first.in_features or m.backend != first.backend for m in members):
        return "the members read different widths or run different backends"
    if any(
        (m.bias is None) != (first.bias is None) or (m.bias is not None and m.bias.dtype != first.bias.dtype) for m in members
    ):
        return "some members have a bias and others not, or biases of different dtypes"
    return None


def _stack(members: list[W8A8Linear]) -> W8A8Linear:
    first = members[0]
    return _w8a8_like(
        first, {t: torch.cat([getattr(m, t).detach() for m in members]) for t in STACKED if getattr(first, t) is not None}
    )


def _w8a8_like(like: W8A8Linear, tensors: dict[str, torch.Tensor]) -> W8A8Linear:
    """A W8A8Linear on `like`'s backend holding `tensors` (weight, weight_scale, bias), prepared."""
    return W8A8Linear.holding(tensors["weight"], tensors["weight_scale"], tensors.get("bias"), like.backend)


def unfuse_projections(model: nn.Module) -> int:
    """Undo fuse_projections: each member a W8A8Linear of its own rows again, and the norm back as a
    RowStableRMSNorm over the same Parameter, as in a group that was never fused (measurements compare
    the two). Returns the number of groups split."""
    split = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, NormFoldedW8A8Linear):
            continue
        layer_name, _, norm_attr = name.rpartition(".")
        _unfuse_in(model.get_submodule(layer_name), norm_attr, module)
        split += 1
    return split


@contextlib.contextmanager
def projections_apart(model: nn.Module) -> Iterator[int]:
    """Within the block, every fused group is split (each projection a W8A8Linear of its own, each norm
    alone: the checkpoint's layout, for code that reads or hooks single projections); after it, fused
    again with the same tensors. Yields how many groups were split. Not for a model another thread runs."""
    split = unfuse_projections(model)
    try:
        yield split
    finally:
        if split:
            fuse_projections(model, log=False)


def _unfuse_in(layer: nn.Module, norm_attr: str, fused: NormFoldedW8A8Linear) -> None:
    stacked = fused.linear
    for path, start, stop in fused.members:
        rows = {t: getattr(stacked, t)[start:stop].clone() for t in STACKED if getattr(stacked, t) is not None}
        layer.set_submodule(path, _w8a8_like(stacked, rows))
    norm = fused.unfolded[0]
    norm.weight = fused.weight  # the Parameter the fused module holds now (a conversion may have replaced it)
    setattr(layer, norm_attr, RowStableRMSNorm(norm))  # what an unfused group's norm runs


def _fused_modules(layer: nn.Module) -> list[tuple[str, NormFoldedW8A8Linear]]:
    return [(name, m) for name, m in layer.named_modules() if isinstance(m, NormFoldedW8A8Linear)]


def split_fused_state(layer: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook of a fused layer: each stacked tensor becomes its members' own (copies)."""
    for name, fused in _fused_modules(layer):
        for tensor in STACKED:
            stacked = state_dict.pop(f"{prefix}{name}.linear.{tensor}", None)
            if stacked is None:
                continue
            for path, start, stop in fused.members:
                state_dict[f"{prefix}{path}.{tensor}"] = stacked[start:stop].clone()


def stack_fused_state(
    layer: nn.Module,
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing: list,
    unexpected: list,
    errors: list,
) -> None:
    """Load-state-dict pre-hook of a fused layer: the members' tensors stacked under the fused linear's
    names. A group given only some of its members' tensors is an error naming the absent ones."""
    for name, fused in _fused_modules(layer):
        for tensor in STACKED:
            keys = [f"{prefix}{path}.{tensor}" for path, _, _ in fused.members]
            present = [key in state_dict for key in keys]
            if all(present):
                _check_member_tensors(fused, keys, tensor, state_dict)
                state_dict[f"{prefix}{name}.linear.{tensor}"] = torch.cat([state_dict.pop(key) for key in keys])
            elif any(present):
                absent = [key for key, there in zip(keys, present) if not there]
                errors.append(f"{', '.join(absent)} missing: {prefix}{name} stacks {len(keys)} projections and loads all or none")
                for key in keys:
                    state_dict.pop(key, None)


def _check_member_tensors(fused: NormFoldedW8A8Linear, keys: list[str], tensor: str, state_dict: dict) -> None:
    """Each member's tensor as that projection alone holds it (int8 [rows, in] weights; [rows] scales and
    biases), refused by its own checkpoint name before any stacking."""
    for key, (_, start, stop) in zip(keys, fused.members):
        value = state_dict[key]
        if tensor == "weight":
            check_int8_weight(key, value, (stop - start, fused.linear.in_features))
        elif isinstance(value, torch.Tensor) and tuple(value.shape) != (stop - start,):
            raise ValueError(
                f"{key}: a tensor of shape {list(value.shape)} cannot load into this {tensor} of shape [{stop - start}]"
            )


def w8a8_weight_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The int8 weight every W8A8 projection loads, under its checkpoint name: {key: (rows, in_features)}."""
    shapes = {}
    for name, linear in checkpoint_linears(model).items():
        columns = _member_columns(model, name, linear)
        shapes[f"{name}.weight"] = (columns, linear.in_features) if columns is not None else tuple(linear.weight.shape)
    return shapes


def _member_columns(model: nn.Module, name: str, linear: W8A8Linear) -> int | None:
    """How many output rows the projection `name` has when it is a member of a fused group, else None."""
    slice_module = model.get_submodule(name)
    return slice_module.out_features if isinstance(slice_module, FusedProjectionSlice) else None


def checkpoint_linears(model: nn.Module) -> dict[str, W8A8Linear]:
    """Every W8A8 projection under its checkpoint name: W8A8Linears as they are, and each member of a
    fused group mapped to the stacked linear that computes it."""
    found: dict[str, W8A8Linear] = {}
    fused_linears = set()
    for name, module in model.named_modules():
        if isinstance(module, NormFoldedW8A8Linear):
            layer = name.rpartition(".")[0]
            for path, _, _ in module.members:
                found[f"{layer}.{path}" if layer else path] = module.linear
            fused_linears.add(id(module.linear))
    for name, module in model.named_modules():
        if isinstance(module, W8A8Linear) and id(module) not in fused_linears:
            found[name] = module
    return found
