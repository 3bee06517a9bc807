"""Fidelity of a W8A8 model against its unquantized reference, on held-out text.

Measures (all teacher-forced on the same token windows):
  * perplexity of both models, and their ratio (target: W8A8 within 1 % of BF16);
  * top-1 agreement: fraction of positions where both models' argmax next tokens agree;
  * mean KL(reference || model) of the next-token distributions, in nats.
And the paper's acceptance comparison (n-gram drafts, greedy):
  * same_drafts: along one fixed trajectory (the reference's greedy output), every position gets
    the same n-gram draft; each verifier's accepted prefix length is counted. The strict
    like-for-like comparison: only the verifier differs.
  * free_running: each verifier runs its own speculative loop; L = tokens per verify step
    (the paper reports L = 1.40 for W8A8 vs 1.33 for BF16 with n-gram drafts).
The held-out text must not be the calibration text: the default is the "heldout" half of the
project's built-in Python-docs split (`quasar_hf.smoothquant.data.builtin_texts`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from quasar_hf import compat
from quasar_hf.speculative.stats import QuasarStats


# ---------------------------------------------------------------- speculative counters
def aggregate_stats(stats_list: list[dict]) -> dict:
    """Sum `QuasarStats.to_dict()` records over runs -> L (tokens per verify step), acceptance per position,
    times per step and per draft token ({} when no run made a verify step)."""
    parts = [QuasarStats.from_dict(s) for s in stats_list if s and s.get("verify_steps")]
    return QuasarStats.total(parts).summary() if parts else {}


# ---------------------------------------------------------------- cached forward for fixed trajectories
def cached_forward(model: torch.nn.Module, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """One cached forward: (logits, cache)."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **{compat.cache_argument_name(model): cache})
    return out["logits"], compat.output_cache(out)


# ---------------------------------------------------------------- the project's speculative loop
def speculative_tokens(
    model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, drafter: str, num_draft_tokens: int
) -> tuple[list[int], dict]:
    """One greedy speculative generation with `model` as verifier: (new tokens, `QuasarStats.to_dict()`)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    from quasar_hf.speculative import QuasarGenerationConfig, speculative_generate

    config = QuasarGenerationConfig(drafter=drafter, num_draft_tokens=num_draft_tokens)
    out = speculative_generate(
        model,
        input_ids,
        torch.ones_like(input_ids),
        quasar_config=config,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        pad_token_id=eos if eos is not None else 0,
    )
    return out.sequences[0, input_ids.shape[1] :].tolist(), out.quasar_stats.to_dict()


# ---------------------------------------------------------------- pure metric pieces
def next_token_sums(model_logits: torch.Tensor, reference_logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """Sums over positions: NLL of both models, top-1 agreements, KL(ref || model). Logits [T, V], targets [T]."""
    if model_logits.shape != reference_logits.shape or model_logits.shape[0] != targets.shape[0]:
        raise ValueError(
            f"logits and targets disagree: model {tuple(model_logits.shape)}, reference "
            f"{tuple(reference_logits.shape)}, targets {tuple(targets.shape)}"
        )
    log_p = F.log_softmax(model_logits.float(), dim=-1)  # [T, V]
    log_q = F.log_softmax(reference_logits.float(), dim=-1)  # [T, V]
    kl = (log_q.exp() * (log_q - log_p)).sum(dim=-1)  # [T]
    return {
        "model_nll": float(-log_p.gather(1, targets[:, None]).sum()),
        "reference_nll": float(-log_q.gather(1, targets[:, None]).sum()),
        "top1_agree": int((log_p.argmax(-1) == log_q.argmax(-1)).sum()),
        "kl": float(kl.sum()),
        "tokens": int(targets.shape[0]),
    }


def finalize_sums(sums: dict) -> dict:
    """Turn summed counters into perplexities, their ratio, agreement and mean KL."""
    n = sums["tokens"]
    if n == 0:
        raise ValueError("no tokens were evaluated: give longer texts (at least 2 tokens each)")
    model_ppl = math.exp(sums["model_nll"] / n)
    reference_ppl = math.exp(sums["reference_nll"] / n)
    return {
        "perplexity_model": model_ppl,
        "perplexity_reference": reference_ppl,
        "perplexity_ratio": model_ppl / reference_ppl,
        "top1_agreement": sums["top1_agree"] / n,
        "mean_kl_nats": sums["kl"] / n,
        "tokens_evaluated": n,
    }


def perplexity_ratio_interval(
    model_nll: list[float], reference_nll: list[float], tokens: list[int], confidence: float = 0.95, resamples: int = 2000
) -> tuple[float, float]:
    """Percentile-bootstrap interval of the perplexity ratio, resampling whole blocks (paired).

    Per-block sums of both models' NLL and token counts; blocks are drawn with replacement and the
    ratio exp((sum model - sum reference) / sum tokens) recomputed. Blocks, not tokens, are the unit:
    errors within a block are correlated. Fixed seed, so a report reproduces.
    """
    if not (len(model_nll) == len(reference_nll) == len(tokens)) or not tokens:
        raise ValueError(
            f"need one NLL pair and token count per block; got {len(model_nll)}, {len(reference_nll)}, {len(tokens)}"
        )
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    gap = torch.tensor(model_nll, dtype=torch.float64) - torch.tensor(reference_nll, dtype=torch.float64)  # [B]
    count = torch.tensor(tokens, dtype=torch.float64)  # [B]
    picks = torch.randint(0, len(tokens), (resamples, len(tokens)), generator=torch.Generator().manual_seed(0))
    ratios = (gap[picks].sum(dim=1) / count[picks].sum(dim=1)).exp()  # [resamples]
    tail = (1 - confidence) / 2
    low, high = torch.quantile(ratios, torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high


def token_windows(tokenizer: Any, texts: list[str], seq_len: int, max_windows: int | None) -> list[torch.Tensor]:
    """Concatenate texts (EOS-separated) and cut non-overlapping windows of seq_len tokens ([seq_len] each)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if isinstance(texts, str) or not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a non-empty list of strings")
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"] + sep)
    windows = [torch.tensor(ids[i : i + seq_len]) for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if not windows:
        windows = [torch.tensor(ids)]
    return windows[:max_windows]


# ---------------------------------------------------------------- model-level measurements
def _logits(model: torch.nn.Module, window: torch.Tensor) -> torch.Tensor:
    """Next-token logits [T, V] of one window [T] (no cache)."""
    device = compat.input_device(model)
    with torch.no_grad():
        return model(input_ids=window[None].to(device), use_cache=False).logits[0].float().cpu()


def compare_next_token(model: torch.nn.Module, reference_model: torch.nn.Module, windows: list[torch.Tensor]) -> dict:
    """Perplexity, top-1 agreement and mean KL of `model` vs `reference_model` over token windows."""
    sums = {"model_nll": 0.0, "reference_nll": 0.0, "top1_agree": 0, "kl": 0.0, "tokens": 0}
    for window in windows:
        part = next_token_sums(_logits(model, window)[:-1], _logits(reference_model, window)[:-1], window[1:])
        for key in sums:
            sums[key] += part[key]
    return finalize_sums(sums)


def same_draft_acceptance(model: torch.nn.Module, trajectory: list[int], start: int, num_draft_tokens: int) -> dict:
    """Accepted draft length at every position >= start of a fixed trajectory, n-gram drafts from its prefix.

    The cache holds trajectory[:t-1] before position t; we feed trajectory[t-1] + draft, count the
    accepted prefix, then crop the draft away so the cache holds trajectory[:t].
    """
    from quasar_hf.speculative.drafters import NgramDrafter
    from quasar_hf.speculative.verify import greedy_accept

    device = compat.input_device(model)
    drafter = NgramDrafter(num_draft_tokens)
    tokens = torch.tensor(trajectory, device=device)
    stats = QuasarStats()
    _, cache = cached_forward(model, tokens[None, : start - 1], None)
    for t in range(start, len(trajectory)):
        draft = drafter.lookup(tokens[:t], num_draft_tokens)  # [d]: the same draft for every verifier
        logits, cache = cached_forward(model, torch.cat([tokens[t - 1 : t], draft])[None], cache)  # [1, 1 + d, V]
        accepted, _ = greedy_accept(draft[None], logits.float())
        if draft.numel():
            cache.crop(-draft.shape[0])  # the cache holds trajectory[:t] again
            kept = int(accepted[0])
            stats.record_step([draft.shape[0]], [kept], [kept + 1])
    return stats.to_dict()


def compare_acceptance(
    model: torch.nn.Module,
    reference_model: torch.nn.Module,
    prompts: list[torch.Tensor],
    max_new_tokens: int = 64,
    num_draft_tokens: int = 5,
) -> dict:
    """L of W8A8 vs reference verification: on the same drafts, and each in its own free-running loop."""
    same = {"model": [], "reference": []}
    free = {"model": [], "reference": []}
    for input_ids in prompts:  # [1, T]
        ref_tokens, ref_stats = speculative_tokens(reference_model, input_ids, max_new_tokens, "ngram", num_draft_tokens)
        _, model_stats = speculative_tokens(model, input_ids, max_new_tokens, "ngram", num_draft_tokens)
        free["reference"].append(ref_stats)
        free["model"].append(model_stats)
        trajectory = input_ids[0].tolist() + ref_tokens
        start = input_ids.shape[1] + 1
        same["model"].append(same_draft_acceptance(model, trajectory, start, num_draft_tokens))
        same["reference"].append(same_draft_acceptance(reference_model, trajectory, start, num_draft_tokens))
    result = {}
    for name, groups in (("same_drafts", same), ("free_running", free)):
        model_agg, ref_agg = aggregate_stats(groups["model"]), aggregate_stats(groups["reference"])
        keep = ("mean_acceptance_length", "acceptance_rate", "acceptance_per_position", "verify_steps", "drafted_tokens")
        result[name] = {
            "model": {k: model_agg.get(k) for k in keep},
            "reference": {k: ref_agg.get(k) for k in keep},
        }
        if model_agg and ref_agg:
            result[name]["L_ratio"] = model_agg["mean_acceptance_length"] / ref_agg["mean_acceptance_length"]
    result["note"] = (
        "same_drafts: drafts taken from the reference's greedy trajectory, L counts only positions with a "
        "draft (accepted + 1 per drafted position); free_running: L = new tokens / verify steps"
    )
    return result


def evaluate_fidelity(
    model: torch.nn.Module,
    reference_model: torch.nn.Module,
    tokenizer: Any,
    texts: list[str] | None = None,
    *,
    seq_len: int = 256,
    max_windows: int | None = 16,
    acceptance_prompts: list[torch.Tensor] | None = None,
    max_new_tokens: int = 64,
    num_draft_tokens: int = 5,
) -> dict:
    """Fidelity of `model` (W8A8) vs `reference_model` (unquantized), on held-out `texts`.

    texts: held-out strings, NOT the calibration text (None = the built-in "heldout" split).
    seq_len / max_windows: evaluation windows of seq_len tokens, at most max_windows of them.
    acceptance_prompts: token-id tensors [1, T] for the acceptance comparison (None skips it).
    Returns {"next_token": {perplexity_model, perplexity_reference, perplexity_ratio,
    top1_agreement, mean_kl_nats, tokens_evaluated}, "acceptance": {...} | None, "config": {...}}.
    """
    source = "caller"
    if texts is None:
        texts, source = heldout_texts(), "builtin:python-docs (heldout split)"
    windows = token_windows(tokenizer, texts, seq_len, max_windows)
    result = {
        "config": {
            "text_source": source,
            "seq_len": seq_len,
            "windows": len(windows),
            "max_new_tokens": max_new_tokens,
            "num_draft_tokens": num_draft_tokens,
        },
        "next_token": compare_next_token(model, reference_model, windows),
        "acceptance": None,
    }
    if acceptance_prompts:
        result["acceptance"] = compare_acceptance(model, reference_model, acceptance_prompts, max_new_tokens, num_draft_tokens)
    return result


def heldout_texts() -> list[str]:
    """The default held-out texts (the built-in split not used for calibration)."""
    from quasar_hf.smoothquant.data import builtin_texts

    return builtin_texts("heldout")
