"""A reduced-vocabulary draft head (FR-Spec): the self-draft path reads only the most frequent lm_head rows.

A draft token through the full `lm_head` reads V x H weights (SmolLM2: 49152 x 576, as many
weights as 8 of its 30 decoder layers). The draft head keeps the N token ids most frequent in the
calibration text; drafting computes logits for those rows only and gives every other token
-inf, so the draft distribution q is a proper distribution over the full vocabulary with zeros
outside the subset. Verification keeps the full head: tokens are decided by the verifier's
logits alone (greedy output unchanged, speculative sampling still exact).

Only the index is stored: `model.quasar_draft_head.token_ids` [N] (saved with the model).
The N x H weight rows are gathered from the shared lm_head when a drafter is built.
"""

from __future__ import annotations

import torch
from torch import nn

from quasar_hf.nn.weight_bytes import module_bytes
from quasar_hf.self_draft.path import self_draft_model
from quasar_hf.smoothquant.mappings import model_decoder_layers

HEAD_ATTR = "quasar_draft_head"


class DraftHeadIndex(nn.Module):
    """Holds the draft head's token ids [N] (sorted, int64) as a saved buffer."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.register_buffer("token_ids", torch.zeros(size, dtype=torch.long))


class ReducedVocabLogits(nn.Module):
    """lm_head restricted to `token_ids`: hidden [..., H] -> logits [..., V], -inf outside the subset."""

    def __init__(self, lm_head: nn.Module, token_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        weight = lm_head.weight
        ids = token_ids.to(weight.device)
        self.register_buffer("token_ids", ids, persistent=False)
        self.register_buffer("weight", weight.detach()[ids].contiguous(), persistent=False)  # [N, H]
        bias = getattr(lm_head, "bias", None)
        self.register_buffer("bias", None if bias is None else bias.detach()[ids].contiguous(), persistent=False)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        subset = nn.functional.linear(hidden.to(self.weight.dtype), self.weight, self.bias)  # [..., N]
        full = subset.new_full((*subset.shape[:-1], self.vocab_size), float("-inf"))  # [..., V]
        return full.index_copy_(-1, self.token_ids, subset)


def token_counts(blocks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences [V] of each token id in calibration blocks [n, T]."""
    flat = blocks.reshape(-1).long()
    if flat.numel() and int(flat.max()) >= vocab_size:
        raise ValueError(f"calibration tokens go up to id {int(flat.max())} but the model's vocabulary has {vocab_size}")
    return torch.bincount(flat, minlength=vocab_size)


def select_head_tokens(counts: torch.Tensor, size: int, always: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent token ids (ties: lower id first), always including `always`; sorted [size]."""
    vocab = counts.numel()
    if not isinstance(size, int) or not 1 <= size <= vocab:
        raise ValueError(f"draft_vocab_size must be an int in [1, {vocab}] (the vocabulary size), got {size!r}")
    forced = sorted({int(t) for t in always if 0 <= int(t) < vocab})
    if len(forced) > size:
        raise ValueError(f"draft_vocab_size={size} is smaller than the {len(forced)} special tokens it must hold")
    # Stable order by (-count, id): sort ids by count descending with a stable sort.
    order = torch.sort(counts.double(), descending=True, stable=True).indices
    keep = torch.zeros(vocab, dtype=torch.bool)
    keep[forced] = True
    rest = order[~keep[order]][: size - len(forced)]  # most frequent first, forced ids left out
    keep[rest] = True
    return keep.nonzero().squeeze(1)


def special_token_ids(model: nn.Module) -> list[int]:
    eos = getattr(model.config, "eos_token_id", None)
    ids = eos if isinstance(eos, (list, tuple)) else [eos]
    generation = getattr(model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None) if generation is not None else None
    ids = list(ids) + (list(extra) if isinstance(extra, (list, tuple)) else [extra])
    return [i for i in ids if isinstance(i, int)]


def attach_draft_head(model: nn.Module, token_ids: torch.Tensor) -> DraftHeadIndex:
    """Register the head index on the model as `quasar_draft_head` (saved with it)."""
    index = DraftHeadIndex(token_ids.numel())
    index.token_ids.copy_(token_ids)
    setattr(model, HEAD_ATTR, index)
    return index


def attach_draft_head_skeleton(model: nn.Module, draft_info: dict | None) -> None:
    """Before loading a saved checkpoint: an empty index of the saved size, when the checkpoint has one."""
    size = (draft_info or {}).get("vocab_size")
    if size:
        setattr(model, HEAD_ATTR, DraftHeadIndex(int(size)))


@torch.no_grad()
def build_draft_head(model: nn.Module, size: int, blocks: torch.Tensor) -> dict:
    """Choose the head's tokens from calibration blocks [n, T] and attach the index; returns draft_info fields."""
    vocab = model.get_output_embeddings().weight.shape[0]
    counts = token_counts(blocks, vocab)
    ids = select_head_tokens(counts, size, special_token_ids(model))
    attach_draft_head(model, ids)
    covered = int(counts[ids].sum())
    return {
        "vocab_size": int(ids.numel()),
        "vocab_selection": f"most frequent tokens in {blocks.numel()} calibration tokens",
        "vocab_coverage": round(covered / max(1, int(counts.sum())), 4),
    }


def head_token_ids(model: nn.Module) -> torch.Tensor | None:
    """The saved draft head's token ids [N], or None when the model has none."""
    index = getattr(model, HEAD_ATTR, None)
    return None if index is None else index.token_ids


def reduced_self_draft_model(model: nn.Module) -> nn.Module:
    """The self-draft path (draft layers) ending in the reduced-vocabulary head, or a clear error."""
    ids = head_token_ids(model)
    if ids is None:
        raise ValueError(
            "drafter='self_reduced' needs a model quantized with a reduced draft head: "
            "QuasarConfig(draft_layers=..., draft_vocab_size=N). Use drafter='self' for the full head."
        )
    draft = self_draft_model(model)
    lm_head = model.get_output_embeddings()
    draft.lm_head = ReducedVocabLogits(lm_head, ids, lm_head.weight.shape[0])
    return draft


def draft_bytes_per_token(model: nn.Module, reduced: bool | None = None) -> dict:
    """Weight bytes read per draft token (draft layers + head rows) vs per verify step (all layers + full head).

    reduced=None uses the reduced head when the model has one. Embedding rows (one per token) and
    norms are left out of both: they are the same few kilobytes either way.
    """
    info = model.config.quantization_config.draft_info or {}
    if not info.get("layers"):
        raise ValueError("this model has no self-draft path (QuasarConfig(draft_layers=...))")
    layers = model_decoder_layers(model)
    if info.get("dtype") == "int8":
        draft_layers = sum(module_bytes(layers[i]) for i in info["layers"])
    else:
        copies = model.quasar_draft
        draft_layers = sum(module_bytes(copies[str(i)]) for i in info["layers"])
    head = model.get_output_embeddings().weight
    row_bytes = head.shape[1] * head.element_size()
    ids = head_token_ids(model)
    use_reduced = (ids is not None) if reduced is None else reduced
    if use_reduced and ids is None:
        raise ValueError("reduced=True but this model has no reduced draft head")
    head_rows = ids.numel() if use_reduced else head.shape[0]
    draft = draft_layers + head_rows * row_bytes
    verify = module_bytes(layers) + head.shape[0] * row_bytes
    return {
        "draft_layer_bytes": draft_layers,
        "draft_head_bytes": head_rows * row_bytes,
        "draft_bytes_per_token": draft,
        "verify_bytes_per_step": verify,
        "draft_over_verify": round(draft / verify, 4),
    }
