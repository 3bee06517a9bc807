"""Everything quasar_hf knows about an architecture, declared once as data and looked up by class name.

One `ArchitectureSpec` per model class (`LlamaForCausalLM`, ...) says:
- `layers_path`: where the decoder layers live;
- `norm`: the RMSNorm class the model uses and its formula, x * rsqrt(mean(x^2) + eps) * (offset + w),
  scaled in fp32 before the cast to x's dtype or after (what `nn.RowStableRMSNorm` computes op for
  op, and what `nn.NormFoldedW8A8Linear` folds);
- `mappings`: the SmoothQuant mappings of one decoder layer (`smooth` -> `balance` linears);
- `fold_groups`: each RMSNorm whose output the layer forward passes to a group of projections and to
  nothing else (q/k/v, gate/up). Fusion (hf/fusion.py) puts the stacked projections in the norm's place,
  which is right only under that rule; hf/fold_check.py traces the forward once per class to confirm
  it, and a group that breaks it stays unfused;
- `rotatable`: the linears (paths in a decoder layer) whose input may be Hadamard-rotated, named in
  `QuasarConfig(rotate=...)` by their last component. No norm produces their input, so smoothing
  does least there.

`spec_for(model)` fails loudly for an unknown class, naming it and the supported ones. Norm classes
are looked up by `norm_formula_for_class`, across every spec.
"""

from __future__ import annotations

from dataclasses import dataclass

MAPPING_KINDS = ("norm", "linear", "grouped_linear")
SMOOTH_ROWS = ("all", "last")


@dataclass(frozen=True)
class RMSNormFormula:
    """A Transformers RMSNorm class: its eps attribute, weight offset (1 for Gemma's (1 + w)), and
    whether it scales by the weight in fp32 before the cast (Gemma) or after (Llama)."""

    class_name: str
    eps_attribute: str = "variance_epsilon"
    offset: float = 0.0
    scale_in_float: bool = False


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
class FoldGroup:
    """A norm (path in the decoder layer) and the projections its output feeds, and nothing else does."""

    norm: str
    projections: tuple[str, ...]


@dataclass(frozen=True)
class ArchitectureMappings:
    """Where the decoder layers live and how each layer is smoothed (a spec's, or a user's own)."""

    layers_path: str
    mappings: tuple[SmoothMapping, ...]


@dataclass(frozen=True)
class ArchitectureSpec:
    """One architecture, as the module docstring describes; the mappings' norm offsets are the norm's."""

    layers_path: str
    norm: RMSNormFormula
    mappings: tuple[SmoothMapping, ...]
    fold_groups: tuple[FoldGroup, ...]
    rotatable: tuple[str, ...] = ("mlp.down_proj", "self_attn.o_proj")

    def __post_init__(self) -> None:
        for m in self.mappings:
            if m.kind not in MAPPING_KINDS or m.smooth_rows not in SMOOTH_ROWS:
                raise ValueError(f"mapping {m} has an unknown kind or smooth_rows")
            if m.kind == "norm" and m.norm_offset != self.norm.offset:
                raise ValueError(f"mapping {m.smooth!r} has norm_offset {m.norm_offset}, its norm {self.norm.offset}")

    @property
    def smoothing(self) -> ArchitectureMappings:
        return ArchitectureMappings(self.layers_path, self.mappings)


def _llama_like(norm: RMSNormFormula) -> ArchitectureSpec:
    """Llama, Mistral, Qwen2 (q/k/v biases: the v bias is scaled with the v rows), Qwen3 (q_norm/k_norm
    after q_proj/k_proj, harmless: q/k output rows are never scaled)."""
    return ArchitectureSpec(
        layers_path="model.layers",
        norm=norm,
        mappings=(
            SmoothMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            SmoothMapping("self_attn.v_proj", ("self_attn.o_proj",), kind="grouped_linear"),
            SmoothMapping("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
            SmoothMapping("mlp.up_proj", ("mlp.down_proj",), kind="linear"),
        ),
        fold_groups=(
            FoldGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            FoldGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ),
    )


# Gemma 3: norms multiply by (1 + w). input_layernorm feeds q/k/v and pre_feedforward_layernorm
# feeds gate/up; post_attention_layernorm and post_feedforward_layernorm normalise the attention
# and MLP *outputs* before the residual add, so no linear reads them and they take no factor.
_GEMMA3 = ArchitectureSpec(
    layers_path="model.layers",
    norm=RMSNormFormula("Gemma3RMSNorm", eps_attribute="eps", offset=1.0, scale_in_float=True),
    mappings=(
        SmoothMapping("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), norm_offset=1.0),
        SmoothMapping("self_attn.v_proj", ("self_attn.o_proj",), kind="grouped_linear"),
        SmoothMapping("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), norm_offset=1.0),
        SmoothMapping("mlp.up_proj", ("mlp.down_proj",), kind="linear"),
    ),
    fold_groups=(
        FoldGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        FoldGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ),
)

# Phi-3: one norm feeds each fused projection (an ordinary norm mapping). v is the last block of
# qkv_proj's rows and up the last half of gate_up_proj's, so only those rows take 1/s.
_PHI3 = ArchitectureSpec(
    layers_path="model.layers",
    norm=RMSNormFormula("Phi3RMSNorm"),
    mappings=(
        SmoothMapping("input_layernorm", ("self_attn.qkv_proj",)),
        SmoothMapping("self_attn.qkv_proj", ("self_attn.o_proj",), kind="grouped_linear", smooth_rows="last"),
        SmoothMapping("post_attention_layernorm", ("mlp.gate_up_proj",)),
        SmoothMapping("mlp.gate_up_proj", ("mlp.down_proj",), kind="linear", smooth_rows="last"),
    ),
    fold_groups=(
        FoldGroup("input_layernorm", ("self_attn.qkv_proj",)),
        FoldGroup("post_attention_layernorm", ("mlp.gate_up_proj",)),
    ),
)

ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "LlamaForCausalLM": _llama_like(RMSNormFormula("LlamaRMSNorm")),
    "MistralForCausalLM": _llama_like(RMSNormFormula("MistralRMSNorm")),
    "Qwen2ForCausalLM": _llama_like(RMSNormFormula("Qwen2RMSNorm")),
    "Qwen3ForCausalLM": _llama_like(RMSNormFormula("Qwen3RMSNorm")),
    "Gemma3ForCausalLM": _GEMMA3,
    "Phi3ForCausalLM": _PHI3,
}
NORM_FORMULAS: dict[str, RMSNormFormula] = {spec.norm.class_name: spec.norm for spec in ARCHITECTURES.values()}


class UnknownArchitectureError(ValueError):
    """A model class with no spec (raised by `spec_for`)."""


def spec_for(model_or_class_name: object) -> ArchitectureSpec:
    """The spec of a model (or a model class name); UnknownArchitectureError naming what is supported."""
    name = model_or_class_name if isinstance(model_or_class_name, str) else type(model_or_class_name).__name__
    spec = ARCHITECTURES.get(name)
    if spec is None:
        raise UnknownArchitectureError(
            f"quasar_hf has no architecture spec for {name!r} (its decoder layers, RMSNorm class, SmoothQuant "
            f"mappings and rotatable linears). Supported: {', '.join(ARCHITECTURES)}. Pass your own SmoothQuant "
            "mappings with QuasarConfig(smoothquant_mappings={'layers_path': 'model.layers', 'mappings': [...]})."
        )
    return spec


def norm_formula_for_class(class_name: str) -> RMSNormFormula | None:
    """The formula of a known RMSNorm class, else None."""
    return NORM_FORMULAS.get(class_name)
