"""SmoothQuant mappings: the architecture spec's (`quasar_hf/architectures.py`, looked up by model
class name) or a user's own, checked against the model's modules.

A mapping says: the output of `smooth` (a norm, or a linear whose output rows can be scaled)
feeds exactly the `balance` linears, so a per-channel factor s can move from the activations
into the weights: Y = (X diag(s)^-1)(diag(s) W). Paths are relative to one decoder layer.
"""

from __future__ import annotations

from torch import nn

from quasar_hf.architectures import (
    ARCHITECTURES,
    MAPPING_KINDS,
    SMOOTH_ROWS,
    ArchitectureMappings,
    SmoothMapping,
    UnknownArchitectureError,
    spec_for,
)

__all__ = ["SMOOTHQUANT_MAPPINGS", "ArchitectureMappings", "SmoothMapping", "decoder_layers", "resolve_mappings"]

# Re-exported: the data lives in the one architecture spec.
SMOOTHQUANT_MAPPINGS: dict[str, ArchitectureMappings] = {name: spec.smoothing for name, spec in ARCHITECTURES.items()}


def parse_custom_mappings(raw: dict) -> ArchitectureMappings:
    """Build mappings from plain data: {"layers_path": "model.layers", "mappings": [
    {"smooth": "input_layernorm", "balance": ["self_attn.q_proj", ...], "kind": "norm"}, ...]}
    (optional per mapping: "norm_offset": 1.0 for (1 + w) norms, "smooth_rows": "last" for fused projections)."""
    try:
        items = tuple(
            SmoothMapping(
                m["smooth"],
                tuple(m["balance"]),
                m.get("kind", "norm"),
                float(m.get("norm_offset", 0.0)),
                m.get("smooth_rows", "all"),
            )
            for m in raw["mappings"]
        )
        arch = ArchitectureMappings(layers_path=raw.get("layers_path", "model.layers"), mappings=items)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            "smoothquant_mappings must look like {'layers_path': 'model.layers', 'mappings': "
            "[{'smooth': 'input_layernorm', 'balance': ['self_attn.q_proj', ...], 'kind': 'norm'}]}; "
            f"got {raw!r} ({err})"
        ) from None
    for m in items:
        if m.kind not in MAPPING_KINDS:
            raise ValueError(f"unknown mapping kind {m.kind!r}; use 'norm', 'linear' or 'grouped_linear'")
        if m.smooth_rows not in SMOOTH_ROWS:
            raise ValueError(f"unknown smooth_rows {m.smooth_rows!r}; use 'all' or 'last'")
        if m.kind == "norm" and m.smooth_rows != "all":
            raise ValueError(f"smooth_rows={m.smooth_rows!r} applies to linear mappings, not the norm {m.smooth!r}")
    return arch


def resolve_mappings(model: nn.Module, custom: dict | None = None) -> ArchitectureMappings:
    """Mappings for this model's class (or the custom ones), checked against the real modules."""
    name = type(model).__name__
    if custom is not None:
        arch = parse_custom_mappings(custom)
    else:
        try:
            arch = spec_for(name).smoothing
        except UnknownArchitectureError as err:
            raise ValueError(
                f"{err} For example smoothquant_mappings={{'layers_path': 'model.layers', 'mappings': "
                "[{'smooth': 'input_layernorm', 'balance': ['self_attn.q_proj', 'self_attn.k_proj', "
                "'self_attn.v_proj'], 'kind': 'norm'}, ...]}, or alpha=0 mappings to quantize without smoothing."
            ) from None
    layers = decoder_layers(model, arch)
    first = layers[0]
    for m in arch.mappings:
        for path in (m.smooth, *m.balance):
            try:
                first.get_submodule(path)
            except AttributeError:
                raise ValueError(
                    f"SmoothQuant mapping for {name} names {path!r}, which decoder layer 0 does not have "
                    f"(its children: {[n for n, _ in first.named_children()]})"
                ) from None
    return arch


def decoder_layers(model: nn.Module, arch: ArchitectureMappings) -> nn.ModuleList:
    """The decoder layer list at `arch.layers_path`, with a clear error if it is not there."""
    return decoder_layers_at(model, arch.layers_path)


def decoder_layers_at(model: nn.Module, path: str) -> nn.ModuleList:
    """The decoder layer list at `path`, with a clear error if it is not there."""
    try:
        layers = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"{type(model).__name__} has no decoder layers at {path!r}") from None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{path!r} in {type(model).__name__} is not a non-empty ModuleList")
    return layers


def layers_path_of(model: nn.Module) -> str:
    """Where `model`'s decoder layers live: the layers_path of the custom SmoothQuant mappings in its
    quantization_config when it has them, else its architecture spec's (UnknownArchitectureError if none)."""
    qconfig = getattr(getattr(model, "config", None), "quantization_config", None)
    custom = qconfig.get("smoothquant_mappings") if isinstance(qconfig, dict) else getattr(qconfig, "smoothquant_mappings", None)
    return parse_custom_mappings(custom).layers_path if custom is not None else spec_for(model).layers_path


def model_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """`model`'s decoder layer list, where `layers_path_of` says."""
    return decoder_layers_at(model, layers_path_of(model))
