"""Choosing the self-draft layers: which layers (greedy removal by agreement) and how many (by bytes).

Which: as in Draft&Verify and SWIFT, layers are dropped one at a time, each time the one whose
removal keeps the draft's top-1 agreement with the full model highest on calibration text.

How many: a draft token pays off only if what it saves exceeds what it reads. With per-token
acceptance a (the measured agreement), k drafted tokens per step and c = draft bytes per token /
verify bytes per step, a memory-bound step emits E[L] = (1 - a^(k+1)) / (1 - a) tokens for
1 + k c verify-steps' worth of bytes. The search keeps removing layers past the budget and keeps
the candidate with the best predicted speedup E[L] / (1 + k c) (best k for each), so the layer
count is chosen by acceptance per byte read, not by agreement alone.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from quasar_hf import compat
from quasar_hf.nn.weight_bytes import module_bytes
from quasar_hf.self_draft.path import build_draft_model, renumbered
from quasar_hf.smoothquant.mappings import model_decoder_layers

MAX_DRAFT_TOKENS = 5  # the speculative loop's default draft length
MIN_LAYER_FRACTION = 0.125  # the search stops at this fraction of the layers (at least 1)


def expected_acceptance_length(agreement: float, num_draft_tokens: int = 5) -> float:
    """E[tokens per verify step] if each draft token is accepted independently with prob `agreement`."""
    if agreement >= 1.0:
        return float(num_draft_tokens + 1)
    return (1.0 - agreement ** (num_draft_tokens + 1)) / (1.0 - agreement)


def predicted_speedup(agreement: float, draft_over_verify: float, max_draft_tokens: int = MAX_DRAFT_TOKENS) -> tuple[float, int]:
    """(best E[L](a, k) / (1 + k c) over k in 1..max_draft_tokens, that k), c = draft/verify bytes.

    The value is the bytes-bound speedup over plain decoding; below 1 the draft does not pay.
    """
    best = max(
        (expected_acceptance_length(agreement, k) / (1.0 + k * draft_over_verify), k) for k in range(1, max_draft_tokens + 1)
    )
    return best[0], best[1]


def layer_bytes(layer: nn.Module, draft_dtype: str) -> int:
    """Weight bytes one decoder layer reads per token as a draft layer.

    "int8": the W8A8 verify layer (linear weights at one byte each, the rest as stored);
    "model": an unquantized copy (every tensor as stored now, before quantization).
    """
    total = module_bytes(layer)
    if draft_dtype != "int8":
        return total
    linear = sum(m.weight.numel() * (m.weight.element_size() - 1) for m in layer.modules() if isinstance(m, nn.Linear))
    return total - linear


@torch.no_grad()
def top1_agreement(model: nn.Module, layer_indices: list[int], blocks: torch.Tensor, reference: torch.Tensor) -> float:
    """Fraction of positions where the skipped-layer model's argmax equals `reference` [N, T]."""
    source = model_decoder_layers(model)
    layers = [renumbered(source[i], slot, deep=False) for slot, i in enumerate(layer_indices)]
    draft = build_draft_model(model, layer_indices, layers)
    device = compat.input_device(model)
    hits = 0
    for block, ref in zip(blocks, reference):
        hits += (draft(input_ids=block[None].to(device), use_cache=False).logits[0].argmax(-1).cpu() == ref).sum().item()
    return hits / reference.numel()


def draft_byte_ratio(model: nn.Module, layers: list[int], draft_dtype: str, head_rows: int | None) -> float:
    """Draft bytes per token / verify bytes per step for a draft of `layers` and `head_rows` head rows."""
    source = model_decoder_layers(model)
    head = model.get_output_embeddings().weight
    row_bytes = head.shape[1] * head.element_size()
    verify = sum(layer_bytes(layer, "int8") for layer in source) + head.shape[0] * row_bytes
    draft = sum(layer_bytes(source[i], draft_dtype) for i in layers) + (head_rows or head.shape[0]) * row_bytes
    return draft / verify


@torch.no_grad()
def select_draft_layers(
    model: nn.Module,
    blocks: torch.Tensor,
    budget: float,
    progress: bool = True,
    draft_dtype: str = "model",
    head_rows: int | None = None,
) -> dict:
    """Greedy layer removal down to MIN_LAYER_FRACTION of the layers; of the candidates within
    `budget` (a fraction of the layers), keep the one with the best predicted speedup per byte.

    Runs on the float model before smoothing. head_rows: rows of the draft head (None: the full
    lm_head). Returns {"layers", "top1_agreement", "predicted_speedup", "draft_tokens",
    "draft_over_verify", "evaluations", "candidates": [per layer count]}.
    """
    from tqdm.auto import tqdm

    num_layers = len(model_decoder_layers(model))
    if num_layers < 2:
        raise ValueError(f"draft_layers='auto' needs at least 2 decoder layers to choose from; this model has {num_layers}")
    target = max(1, math.floor(budget * num_layers))
    floor = max(1, min(target, math.ceil(MIN_LAYER_FRACTION * num_layers)))
    device = compat.input_device(model)
    reference = torch.stack([model(input_ids=b[None].to(device), use_cache=False).logits[0].argmax(-1).cpu() for b in blocks])
    kept = list(range(num_layers))
    candidates, evaluations = [], 0
    with tqdm(total=num_layers - floor, desc="Quasar draft-layer search", disable=not progress) as bar:
        while len(kept) > floor:
            scores = {}
            for layer in kept:
                scores[layer] = top1_agreement(model, [i for i in kept if i != layer], blocks, reference)
                evaluations += 1
            drop = max(scores, key=scores.__getitem__)
            kept.remove(drop)
            if len(kept) <= target:
                ratio = draft_byte_ratio(model, kept, draft_dtype, head_rows)
                speedup, k = predicted_speedup(scores[drop], ratio)
                candidates.append(
                    {
                        "num_layers": len(kept),
                        "layers": list(kept),
                        "top1_agreement": round(scores[drop], 4),
                        "draft_over_verify": round(ratio, 4),
                        "predicted_speedup": round(speedup, 4),
                        "draft_tokens": k,
                    }
                )
            bar.update(1)
    best = max(candidates, key=lambda c: c["predicted_speedup"])
    return {
        "layers": best["layers"],
        "top1_agreement": best["top1_agreement"],
        "predicted_speedup": best["predicted_speedup"],
        "draft_tokens": best["draft_tokens"],
        "draft_over_verify": best["draft_over_verify"],
        "evaluations": evaluations,
        "candidates": [{k: v for k, v in c.items() if k != "layers"} for c in candidates],
    }
