"""Per-architecture SmoothQuant mappings, declared as data and looked up by model class name.

A mapping says: the output of `smooth` (a norm, or a linear whose output rows can be scaled)
feeds exactly the `balance` linears, so a per-channel factor s can move from the activations
into the weights: Y = (X diag(s)^-1)(diag(s) W). Paths are relative to one decoder layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

MAPPING_KINDS = ("norm", "linear", "grouped_linear")
SMOOTH_ROWS = ("all", "last")


@dataclass(frozen=True)
class SmoothMapping:
    """`smooth` -> `balance` linears. kind: "norm" (RMSNorm weight), "linear" (rows of a linear),
    or "grouped_linear" (v_proj -> o_proj under grouped-query attention: one factor per KV channel,
    shared by the query heads that read it).

    norm_offset: the norm multiplies by (norm_offset + weight): 0 for Llama-style norms, 1 for
    Gemma's (1 + w) RMSNorm. smooth_rows: "all" output rows of the smooth linear feed the balance
    linears, or only the "last" ones (a fused projection: v inside qkv_proj, up inside gate_up_proj).
    """

    smooth: str
    balance: tuple[str, ...]
    kind: str = "norm"
    norm_offset: float = 0.0
    smooth_rows: str = "all"


@dataclass(frozen=True)
class ArchitectureMappings:
    """Where the decoder layers live and how each layer is smoothed."""

    layers_path: str
    mappings: tuple[SmoothMapping, ...]


_LLAMA_LIKE = ArchitectureMappings(
    layers_path="model.layers",
    mappings=(
        SmoothMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        SmoothMapping("self_attn.v_proj", ("self_attn.o_proj",), kind="grouped_linear"),
        SmoothMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        SmoothMapping("mlp.up_proj", ("mlp.down_proj",), kind="linear"),
    ),
)

# Gemma 3: norms multiply by (1 + w). input_layernorm feeds q/k/v and pre_feedforward_layernorm
# feeds gate/up; post_attention_layernorm and post_feedforward_layernorm normalise the attention
# and MLP *outputs* before the residual add, so no linear reads them and they take no factor.
# q_norm/k_norm follow q_proj/k_proj, which is harmless: we never scale q/k output rows.
_GEMMA3 = ArchitectureMappings(
    layers_path="model.layers",
    mappings=(
        SmoothMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), norm_offset=1.0),
        SmoothMapping("self_attn.v_proj", ("self_attn.o_proj",), kind="grouped_linear"),
        SmoothMapping("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), norm_offset=1.0),
        SmoothMapping("mlp.up_proj", ("mlp.down_proj",), kind="linear"),
    ),
)

# Phi-3: one norm feeds each fused projection (an ordinary norm mapping). v is the last block of
# qkv_proj's rows and up the last half of gate_up_proj's, so only those rows take 1/s.
_PHI3 = ArchitectureMappings(
    layers_path="model.layers",
    mappings=(
        SmoothMapping("input_layernorm", ("self_attn.qkv_proj",)),
        SmoothMapping("self_attn.qkv_proj", ("self_attn.o_proj",), kind="grouped_linear", smooth_rows="last"),
        SmoothMapping("post_attention_layernorm", ("mlp.gate_up_proj",)),
        SmoothMapping("mlp.gate_up_proj", ("mlp.down_proj",), kind="linear", smooth_rows="last"),
    ),
)

# Qwen2 adds q/k/v biases (the v bias is scaled with the v rows); Qwen3 adds q_norm/k_norm after
# q_proj/k_proj, which does not matter since we never scale q/k output rows.
SMOOTHQUANT_MAPPINGS: dict[str, ArchitectureMappings] = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": _LLAMA_LIKE,
    "Qwen2ForCausalLM": _LLAMA_LIKE,
    "Qwen3ForCausalLM": _LLAMA_LIKE,
    "Gemma3ForCausalLM": _GEMMA3,
    "Phi3ForCausalLM": _PHI3,
}


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
    elif name in SMOOTHQUANT_MAPPINGS:
        arch = SMOOTHQUANT_MAPPINGS[name]
    else:
        supported = ", ".join(SMOOTHQUANT_MAPPINGS)
        raise ValueError(
            f"quasar_hf has no SmoothQuant mappings for architecture {name!r}. Supported: {supported}. "
            "Pass your own with QuasarConfig(smoothquant_mappings={'layers_path': 'model.layers', "
            "'mappings': [{'smooth': 'input_layernorm', 'balance': ['self_attn.q_proj', "
            "'self_attn.k_proj', 'self_attn.v_proj'], 'kind': 'norm'}, ...]}), or alpha=0 mappings "
            "to quantize without smoothing."
        )
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
    try:
        layers = model.get_submodule(arch.layers_path)
    except AttributeError:
        raise ValueError(f"{type(model).__name__} has no decoder layers at {arch.layers_path!r}") from None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{arch.layers_path!r} in {type(model).__name__} is not a non-empty ModuleList")
    return layers
