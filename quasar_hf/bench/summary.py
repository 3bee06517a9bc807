"""Summaries of interleaved benchmark runs: tokens/s, L, headline ratios, L ratio with its interval.

Pure functions over the run records `runner.run_bench` collects (one dict per prompt x variant x
repeat with "variant", "prompt_index", "repeat", "tokens", "seconds", "stats").
"""

from __future__ import annotations

import statistics

import torch

from quasar_hf.bench.fidelity import aggregate_stats

BASELINE = "bf16_verify_ngram"


def summarize_variant(runs: list[dict]) -> dict:
    """Median tokens/s over repeats (each repeat = all prompts), L, acceptance per position, times."""
    by_repeat: dict[int, list[dict]] = {}
    for r in runs:
        by_repeat.setdefault(r["repeat"], []).append(r)
    rates = [sum(len(r["tokens"]) for r in rs) / sum(r["seconds"] for r in rs) for rs in by_repeat.values()]
    summary = {
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s_repeats": rates,
        "new_tokens": sum(len(r["tokens"]) for r in runs),
        "peak_memory_bytes": max((r["peak_memory_bytes"] or 0) for r in runs) or None,
    }
    summary.update(aggregate_stats([r["stats"] for r in runs]))
    return summary


def headline_ratios(summaries: dict[str, dict]) -> dict[str, float]:
    """Each variant's median tokens/s divided by the BF16-verify loop's (empty if it did not run)."""
    if BASELINE not in summaries:
        return {}
    base = summaries[BASELINE]["tokens_per_s_median"]
    return {name: s["tokens_per_s_median"] / base for name, s in summaries.items()}


def acceptance_length_ratio(
    runs: list[dict], variant: str, baseline: str = BASELINE, resamples: int = 2000, seed: int = 0
) -> dict | None:
    """L(variant) / L(baseline) with L = new tokens / verify steps summed over prompts, and a
    paired bootstrap 95% interval over prompts (the spread that which prompts were chosen causes:
    per-prompt L ranges widely, because the two models write different continuations)."""

    def totals(name: str) -> dict[int, tuple[int, int]]:
        out: dict[int, tuple[int, int]] = {}
        for r in runs:
            if r["variant"] == name and r.get("stats") and r["repeat"] == 0:
                out[r["prompt_index"]] = (r["stats"]["new_tokens"], r["stats"]["verify_steps"])
        return out

    mine, base = totals(variant), totals(baseline)
    prompts = sorted(set(mine) & set(base))
    if not prompts:
        return None

    def ratio(sample: list[int]) -> float:
        l_mine = sum(mine[p][0] for p in sample) / max(1, sum(mine[p][1] for p in sample))
        l_base = sum(base[p][0] for p in sample) / max(1, sum(base[p][1] for p in sample))
        return l_mine / l_base

    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, len(prompts), (resamples, len(prompts)), generator=gen).tolist()
    boot = sorted(ratio([prompts[i] for i in row]) for row in picks)
    return {
        "ratio": ratio(prompts),
        "ci95": [boot[int(0.025 * resamples)], boot[int(0.975 * resamples) - 1]],
        "prompts": len(prompts),
        "baseline": baseline,
    }


def mark_token_agreement(summaries: dict[str, dict], runs: list[dict]) -> None:
    """Fraction of runs whose tokens equal bf16_generate's on the same prompt (greedy => should be 1.0)."""
    reference = {r["prompt_index"]: r["tokens"] for r in runs if r["variant"] == "bf16_generate"}
    if not reference:
        return
    for name, summary in summaries.items():
        mine = [r for r in runs if r["variant"] == name]
        same = sum(r["tokens"] == reference[r["prompt_index"]] for r in mine)
        summary["same_tokens_as_bf16_generate"] = same / len(mine)
