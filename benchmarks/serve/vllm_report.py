"""Verdicts and tables of `python -m benchmarks vllm-check` (benchmarks/serve/vllm_check.py): pure functions
of its raw per-model results, so they are tested without vLLM."""

from __future__ import annotations

import statistics


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tokens_per_second(run: dict | None) -> float | None:
    """Generated tokens over seconds, summed over prompts."""
    if not run or not run.get("seconds"):
        return None
    return sum(len(t) for t in run["tokens"]) / sum(run["seconds"])


def divergence(ours: list[int], theirs: list[int], our_top2, their_top2, our_logit_of_theirs) -> dict | None:
    """Where vLLM's plain tokens leave ours: the position, both tokens and both sides' gaps (nats).

    our_gap: our logit of our token minus our logit of vLLM's token there (>= 0 for a greedy
    choice). their_gap: vLLM's log-probability of its token minus that of ours, when ours is in its
    top 2; otherwise a lower bound (its top-1 minus top-2), flagged `their_gap_is_lower_bound`."""
    i = first_difference(ours, theirs)
    if i is None:
        return None
    if i >= len(ours) or i >= len(theirs):
        return {"position": i, "stopped_early": "ours" if i >= len(ours) else "vllm"}
    mine, other = ours[i], theirs[i]
    our_logits = dict((int(t), v) for t, v in our_top2[i])
    row = {"position": i, "our_token": mine, "vllm_token": other}
    row["our_gap"] = our_logits.get(mine, max(our_logits.values())) - our_logit_of_theirs
    their = dict((int(t), v) for t, v in their_top2[i]) if their_top2 and i < len(their_top2) else {}
    if mine in their and other in their:
        row["their_gap"], row["their_gap_is_lower_bound"] = their[other] - their[mine], False
    elif len(their) == 2:
        best, second = sorted(their.values(), reverse=True)
        row["their_gap"], row["their_gap_is_lower_bound"] = best - second, True
    return row


def gap_noise(ours: list[int], theirs: list[int], our_top2, their_top2) -> list[float]:
    """|our top-2 gap - vLLM's| at the positions both decode alike and rank the same two tokens."""
    end = first_difference(ours, theirs)
    end = min(len(ours), len(theirs)) if end is None else end
    noise = []
    for j in range(min(end, len(our_top2), len(their_top2))):
        (a, va), (b, vb) = our_top2[j]
        (c, vc), (d, vd) = their_top2[j]
        if (int(a), int(b)) == (int(c), int(d)):
            noise.append(abs((va - vb) - (vc - vd)))
    return noise


def summarize_model(raw: dict, near_tie: float) -> dict:
    """The verdicts for one model: export loads, n-gram == plain, near-tie divergences, serve, speed."""
    ours = raw["ours"]
    summary: dict = {"ours_quasar_equals_plain": ours["quasar_eager"]["tokens"] == ours["plain"]["tokens"]}
    summary["tokens_per_s"] = {f"ours {mode}": tokens_per_second(run) for mode, run in ours.items()}
    vllm = raw.get("vllm", {})
    if "skipped" in vllm:
        summary["passed"] = None
        return summary
    modes = vllm.get("modes", {})
    plain, ngram, serve = modes.get("plain"), modes.get("ngram"), modes.get("serve")
    summary["error"] = vllm.get("error")
    summary["export_loads"] = plain is not None
    summary["ngram_equals_plain"] = bool(plain and ngram and ngram["tokens"] == plain["tokens"])
    summary["tokens_per_s"].update({"vllm plain": tokens_per_second(plain), "vllm ngram": tokens_per_second(ngram)})
    summary["startup_s"] = {mode: run.get("startup_s") for mode, run in modes.items()}
    divergences, noise = [], []
    if plain:
        for k, (mine, theirs) in enumerate(zip(ours["plain"]["tokens"], plain["tokens"])):
            their_top2 = plain["top2"][k] if plain.get("top2") else None
            divergences.append(divergence(mine, theirs, raw["ours_top2"][k], their_top2, raw["ours_logit_of_vllm_token"][k]))
            noise += gap_noise(mine, theirs, raw["ours_top2"][k], their_top2 or [])
    summary["divergences"] = divergences
    summary["gap_noise"] = {"positions": len(noise), "median": statistics.median(noise), "max": max(noise)} if noise else None
    summary["all_divergences_near_ties"] = bool(plain) and all(
        d is None or ("our_gap" in d and d["our_gap"] <= near_tie) for d in divergences
    )
    answers = (serve or {}).get("answers") or []
    summary["served"] = None if "serve" not in modes and not vllm.get("error") else bool(answers and answers[0]["text"])
    summary["passed"] = bool(
        summary["ours_quasar_equals_plain"]
        and summary["export_loads"]
        and summary["ngram_equals_plain"]
        and summary["all_divergences_near_ties"]
        and summary["served"] in (True, None)
        and not summary["error"]
    )
    return summary


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def model_section(name: str, entry: dict, near_tie: float) -> list[str]:
    s = entry["summary"]
    lines = [f"## {name}", "", f"- provenance: {entry['provenance']}", f"- export: {entry['export']}"]
    lines.append(f"- ours: eager `quasar=True` tokens = plain greedy tokens on every prompt: {s['ours_quasar_equals_plain']}")
    if s["passed"] is None:
        return lines + [f"- vLLM: {entry['vllm']['skipped']}", ""]
    lines += [
        f"- vLLM {entry['vllm'].get('vllm_version', '?')} loads the export and decodes: {s['export_loads']}; engine start-up s: "
        + ", ".join(f"{k} {_fmt(v, 0)}" for k, v in s["startup_s"].items()),
        f"- vLLM n-gram tokens = vLLM plain tokens on every prompt: {s['ngram_equals_plain']}",
        f"- every vLLM-vs-ours divergence at a near-tie (our gap <= {near_tie} nats): {s['all_divergences_near_ties']}",
        f"- `vllm serve` answered an `openai` chat request: {s['served']}",
    ]
    if s.get("error"):
        lines += ["", "```", s["error"], "```"]
    lines += [
        "",
        "| prompt | first difference | our token / vLLM's | our gap (nats) | vLLM's gap (nats) |",
        "|---|---|---|---|---|",
    ]
    for k, d in enumerate(s["divergences"]):
        if d is None:
            lines.append(f"| {k} | none (identical) | - | - | - |")
        elif "stopped_early" in d:
            lines.append(f"| {k} | {d['position']} ({d['stopped_early']} stopped) | - | - | - |")
        else:
            bound = "> " if d.get("their_gap_is_lower_bound") else ""
            their = f"{bound}{d['their_gap']:.3f}" if "their_gap" in d else "-"
            lines.append(f"| {k} | {d['position']} | {d['our_token']} / {d['vllm_token']} | {d['our_gap']:.3f} | {their} |")
    if s["gap_noise"]:
        n = s["gap_noise"]
        lines += [
            "",
            f"Top-2 gap disagreement where both agree: median {n['median']:.3f}, max {n['max']:.3f} nats over {n['positions']} positions.",
        ]
    lines += ["", "| decoding | tokens/s |", "|---|---|"]
    lines += [f"| {mode} | {_fmt(rate, 1)} |" for mode, rate in s["tokens_per_s"].items()]
    answers = (entry["vllm"].get("modes", {}).get("serve") or {}).get("answers") or []
    if answers:
        lines += [
            "",
            f"Served answer ({answers[0]['completion_tokens']} tokens, {answers[0]['seconds']:.1f} s): {answers[0]['text']!r}",
        ]
    return lines + [""]


def to_markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        "# vLLM serving check of the default Quasar checkpoint (compressed-tensors export)",
        "",
        f"`{result['command']}`",
        "",
        f"- machine: {env.get('cpu')}, {env.get('cpu_count')} CPUs; torch threads {env.get('torch_threads')}; "
        f"commit {env.get('git_commit')}; load average at start {env.get('load_average')}",
        f"- vLLM settings: {result['vllm_settings']}; greedy, {result['max_new_tokens']} new tokens, "
        f"{len(result['prompts'])} prompts, batch 1",
        "",
    ]
    for name, entry in result["models"].items():
        lines += model_section(name, entry, result["near_tie_nats"])
    return "\n".join(lines) + "\n"
