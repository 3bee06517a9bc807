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

import copy
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------- speculative counters
def new_stats() -> dict:
    """Counters of one speculative run (the same names as quasar_hf.speculative's QuasarStats)."""
    return {
        "verify_steps": 0,
        "drafted_tokens": 0,
        "accepted_tokens": 0,
        "emitted_tokens": 0,
        "drafted_at_position": [],
        "accepted_at_position": [],
        "draft_time_s": 0.0,
        "verify_time_s": 0.0,
    }


def record_step(stats: dict, draft_len: int, accepted: int) -> None:
    """Add one verify step that checked `draft_len` drafted tokens and accepted `accepted` of them."""
    for key in ("drafted_at_position", "accepted_at_position"):
        stats[key].extend([0] * max(0, draft_len - len(stats[key])))
    for i in range(draft_len):
        stats["drafted_at_position"][i] += 1
        stats["accepted_at_position"][i] += int(i < accepted)
    stats["verify_steps"] += 1
    stats["drafted_tokens"] += draft_len
    stats["accepted_tokens"] += accepted
    stats["emitted_tokens"] += accepted + 1


def aggregate_stats(stats_list: list[dict]) -> dict:
    """Sum counters over runs -> L (tokens per verify step), acceptance per position, times per step/token.

    L = emitted tokens / verify steps, counting steps without a draft (what sets the speed);
    acceptance_per_position[i] = P(draft token i accepted | it was drafted).
    """
    stats_list = [s for s in stats_list if s and s.get("verify_steps")]
    if not stats_list:
        return {}
    total = new_stats()
    for s in stats_list:
        for key in ("verify_steps", "drafted_tokens", "accepted_tokens", "emitted_tokens", "draft_time_s", "verify_time_s"):
            total[key] += s[key]
        width = len(s["drafted_at_position"])
        for key in ("drafted_at_position", "accepted_at_position"):
            counts = total[key]
            counts.extend([0] * max(0, width - len(counts)))
            for i, c in enumerate(s[key][:width]):
                counts[i] += c
    steps = total["verify_steps"]
    return {
        "verify_steps": steps,
        "drafted_tokens": total["drafted_tokens"],
        "accepted_tokens": total["accepted_tokens"],
        "mean_acceptance_length": total["emitted_tokens"] / steps,
        "acceptance_rate": total["accepted_tokens"] / max(1, total["drafted_tokens"]),
        "acceptance_per_position": [a / d for a, d in zip(total["accepted_at_position"], total["drafted_at_position"]) if d],
        "time_per_verify_step_s": total["verify_time_s"] / steps,
        "time_per_draft_token_s": total["draft_time_s"] / max(1, total["drafted_tokens"]),
    }


# ---------------------------------------------------------------- cached forward for fixed trajectories
def _forward(model: torch.nn.Module, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """One cached forward; works with Transformers 5.17 (`past_key_values`) and 5.24 (`cache`)."""
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **{cache_kwarg: cache})
    new_cache = out["cache"] if "cache" in out else out["past_key_values"]
    return out["logits"], new_cache


def _crop(cache: Any, remove: int) -> None:
    """Drop the last `remove` positions of a DynamicCache (negative crop: Transformers 5.17 and 5.24)."""
    if remove > 0:
        cache.crop(-remove)


# ---------------------------------------------------------------- the project's speculative loop
def resolve_loop(loop: str) -> str:
    """Validate the `loop` option: the project's speculative loop is the only one ("auto" = "project")."""
    if loop not in ("auto", "project"):
        raise ValueError(f"loop must be 'auto' or 'project', got {loop!r}")
    return "project"


def _stats_from_project(quasar_stats: Any) -> dict:
    """Translate a quasar_hf.speculative QuasarStats into this module's counters (same definitions)."""
    stats = new_stats()
    stats.update(
        verify_steps=int(quasar_stats.verify_steps),
        drafted_tokens=int(quasar_stats.drafted_tokens),
        accepted_tokens=int(quasar_stats.accepted_tokens),
        emitted_tokens=int(quasar_stats.new_tokens),
        drafted_at_position=list(quasar_stats.drafted_per_position),
        accepted_at_position=list(quasar_stats.accepted_per_position),
        draft_time_s=float(quasar_stats.draft_time_s),
        verify_time_s=float(quasar_stats.verify_time_s),
    )
    return stats


def speculative_tokens(
    model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, drafter: str, num_draft_tokens: int, loop: str
) -> tuple[list[int], dict]:
    """Run one greedy speculative generation with `model` as verifier, via the chosen loop."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    resolve_loop(loop)
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
    return out.sequences[0, input_ids.shape[1] :].tolist(), _stats_from_project(out.quasar_stats)


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
    device = next(model.parameters()).device
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

    device = next(model.parameters()).device
    drafter = NgramDrafter(num_draft_tokens)
    tokens = torch.tensor(trajectory, device=device)
    stats = new_stats()
    _, cache = _forward(model, tokens[None, : start - 1], None)
    for t in range(start, len(trajectory)):
        draft = drafter.lookup(tokens[:t], num_draft_tokens)  # [d]: the same draft for every verifier
        logits, cache = _forward(model, torch.cat([tokens[t - 1 : t], draft])[None], cache)  # [1, 1 + d, V]
        accepted, _ = greedy_accept(draft[None], logits.float())
        _crop(cache, draft.shape[0])
        if draft.numel():
            record_step(stats, draft.shape[0], int(accepted[0]))
    return stats


def compare_acceptance(
    model: torch.nn.Module,
    reference_model: torch.nn.Module,
    prompts: list[torch.Tensor],
    max_new_tokens: int = 64,
    num_draft_tokens: int = 5,
    loop: str = "auto",
) -> dict:
    """L of W8A8 vs reference verification: on the same drafts, and each in its own free-running loop."""
    same = {"model": [], "reference": []}
    free = {"model": [], "reference": []}
    for input_ids in prompts:  # [1, T]
        ref_tokens, ref_stats = speculative_tokens(reference_model, input_ids, max_new_tokens, "ngram", num_draft_tokens, loop)
        _, model_stats = speculative_tokens(model, input_ids, max_new_tokens, "ngram", num_draft_tokens, loop)
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
    loop: str = "auto",
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
        result["acceptance"] = compare_acceptance(
            model, reference_model, acceptance_prompts, max_new_tokens, num_draft_tokens, loop
        )
    return result


def fidelity_main(argv: list[str] | None = None) -> list[str]:
    """CLI: W8A8 vs BF16 (and BF16 vs FP32, for scale) on held-out text + L comparison; write reports."""
    import argparse
    import shlex
    import sys

    from quasar_hf.bench.report import write_reports
    from quasar_hf.bench.runner import load_bench_models
    from quasar_hf.bench.suites import load_suites, render_prompt

    parser = argparse.ArgumentParser(prog="python -m quasar_hf.bench.fidelity", description=fidelity_main.__doc__)
    parser.add_argument("--model", default=None, help="checkpoint (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--quantized", default=None, help="saved Quasar checkpoint (default: quantize now)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-windows", type=int, default=16)
    parser.add_argument("--suites", default="all")
    parser.add_argument("--limit-per-suite", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--skip-fp32", action="store_true", help="skip the BF16/W8A8 vs FP32 comparison")
    parser.add_argument("--out", default="benchmarks")
    parser.add_argument("--name", default="fidelity_cpu")
    args = parser.parse_args(argv)
    command = "python -m quasar_hf.bench.fidelity " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    reference, quantized, tokenizer, info = load_bench_models(args.model, args.quantized)
    prompts = [torch.tensor([render_prompt(it, tokenizer)]) for it in load_suites(args.suites, args.limit_per_suite)]
    result = {
        "command": command,
        "models": info,
        "fidelity": evaluate_fidelity(quantized, reference, tokenizer, None, seq_len=args.seq_len, max_windows=args.max_windows),
    }
    write = lambda: write_reports(result, args.out, args.name, title="quasar_hf fidelity: W8A8 vs unquantized")  # noqa: E731
    write()  # partial results first: the acceptance comparison is the slow part
    if not args.skip_fp32:
        fp32 = copy.deepcopy(reference).float()
        windows = token_windows(tokenizer, heldout_texts(), args.seq_len, args.max_windows)
        result["bf16_vs_fp32"] = compare_next_token(reference, fp32, windows)
        result["w8a8_vs_fp32"] = compare_next_token(quantized, fp32, windows)
        del fp32
        write()
    result["fidelity"]["acceptance"] = compare_acceptance(quantized, reference, prompts, args.max_new_tokens)
    return write()


def heldout_texts() -> list[str]:
    """The default held-out texts (the built-in split not used for calibration)."""
    from quasar_hf.smoothquant.data import builtin_texts

    return builtin_texts("heldout")


if __name__ == "__main__":
    for path in fidelity_main():
        print(path)
