"""Processed scores of many rows (and verified positions) in few calls, bit for bit what one call per row gives.

The rows of a serving batch come from different requests, so each has its own LogitsProcessorList, and each
verified position its own prefix. `reference_scores` is the plain way: one list call per (row, position), the
oracle the tests compare against. `processed_scores` gives the same bits with fewer calls: a run of processors
that neither read input_ids nor keep state, and whose kernels compute each row on its own (`stack_key`), is
applied once to the stacked scores of every item whose run has equal settings; the other processors (they read
each row's own prefix: repetition penalty, min-new-tokens, n-gram bans, a class not known here) are called for
each item alone, in the order its list gives.

`verified_scores` is what the loop calls for such rows: it also leaves out the positions a row's acceptance will
not read (those after its first rejected draft token, found from the scores processed so far and, for a sampled
row with its own uniforms, from the token each position's uniform chooses), so a step processes as many positions
as it emits tokens.

Stacked only on the CPU, where each kernel such a warper calls (elementwise ops, softmax and cumsum along the
last dim, sort, topk, amax) computes a row alone whatever else is stacked with it. Warpers whose kernels sum
across the vocabulary (typical, eta: a sum over one row is split among threads, over several rows it is not)
give other bits stacked, so they are never stacked; neither is anything on other devices.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .drafters import Draft
from .row_rules import RowRules
from .token_uniforms import choose_token

# Stackable classes (exactly these, not subclasses) -> the attributes an instance holds, all of its settings.
STACKABLE: dict[type, tuple[str, ...]] = {
    TemperatureLogitsWarper: ("temperature",),
    TopKLogitsWarper: ("top_k", "filter_value", "min_tokens_to_keep"),
    TopPLogitsWarper: ("top_p", "filter_value", "min_tokens_to_keep"),
    MinPLogitsWarper: ("min_p", "filter_value", "min_tokens_to_keep"),
    EpsilonLogitsWarper: ("epsilon", "filter_value", "min_tokens_to_keep"),
}
STACKING_DEVICES = ("cpu",)


def stack_key(processor: object) -> tuple | None:
    """Class and settings of a processor that may be applied to stacked rows; None when it may not (an unknown
    class or subclass, an instance holding other attributes than its settings, a setting that is not a plain number)."""
    names = STACKABLE.get(type(processor))
    if names is None or set(vars(processor)) != set(names):
        return None
    key: list = [type(processor)]
    for name in names:
        value = getattr(processor, name)
        if type(value) not in (int, float, bool) or value != value:  # a tensor, a NaN...: not compared here
            return None
        key.append((type(value), value.hex() if isinstance(value, float) else value))  # 0.0 and -0.0 differ
    return tuple(key)


def reference_scores(processors: list[LogitsProcessorList], prefixes: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    """Scores [N, V] of item i: its own list called on its prefix [1, T_i] and a copy of its logits [1, V]."""
    return torch.cat([lst(prefix[None], logits[i : i + 1].clone()) for i, (lst, prefix) in enumerate(zip(processors, prefixes))])


def processed_scores(processors: list[LogitsProcessorList], prefixes: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    """What `reference_scores` gives, stacking runs of processors of equal settings across items (module docstring).
    processors[i], prefixes[i] (1-D): item i's; logits [N, V] float."""
    if logits.device.type not in STACKING_DEVICES:
        return reference_scores(processors, prefixes, logits)
    plans = [_runs(lst) for lst in processors]
    scores = [logits[i : i + 1].clone() for i in range(logits.shape[0])]
    done = [0] * len(plans)  # runs of each item's plan applied so far
    while True:
        groups: dict[tuple, list[int]] = {}  # items waiting at a stackable run, by its settings
        for i, plan in enumerate(plans):
            while done[i] < len(plan) and plan[done[i]][0] is None:  # reads its prefix or is not known here: alone
                scores[i] = LogitsProcessorList(plan[done[i]][1])(prefixes[i][None], scores[i])
                done[i] += 1
            if done[i] < len(plan):
                groups.setdefault(plan[done[i]][0], []).append(i)
        if not groups:
            break
        for items in groups.values():
            run = plans[items[0]][done[items[0]]][1]
            stacked = torch.cat([scores[i] for i in items])
            out = LogitsProcessorList(run)(stacked.new_zeros((len(items), 0), dtype=torch.long), stacked)
            for j, i in enumerate(items):
                scores[i] = out[j : j + 1]
                done[i] += 1
    return torch.cat(scores) if scores else logits.clone()


def _runs(processors: LogitsProcessorList) -> list[tuple[tuple | None, list]]:
    """A list split into runs, in order: (key of the run's settings, its processors) for a run of stackable ones,
    (None, [processor]) for each other processor."""
    runs: list[tuple[tuple | None, list]] = []
    for processor in processors:
        key = stack_key(processor)
        if key is not None and runs and runs[-1][0] is not None:
            runs[-1] = (runs[-1][0] + (key,), runs[-1][1] + [processor])
        elif key is not None:
            runs.append(((key,), [processor]))
        else:
            runs.append((None, [processor]))
    return runs


def verified_scores(
    rules: list[RowRules],
    sequences: list[torch.Tensor],
    draft: Draft,
    logits: torch.Tensor,
    lengths: list[int] | None = None,
) -> torch.Tensor:
    """Processed scores [B, k+1, V] of rows of several requests (rules[i], its tokens so far sequences[i], its draft)
    at the positions `accept` reads, position by position: a row goes on to its next position only while its draft
    token may be accepted (greedy: the token holds the maximum; a sampled row with its own uniforms: the token is
    the one its uniform chooses). Past that, its positions keep their logits: accept keeps a row's leading accepted
    drafts only, so it reads none of them, and nothing is emitted from them. `lengths`: draft.lengths as a list,
    when the caller has read it."""
    lengths = draft.lengths.tolist() if lengths is None else lengths  # the caller's host copy: no second sync
    uniforms = [rule.uniforms.peek(length + 1) if _own_uniforms(rule, draft) else None for rule, length in zip(rules, lengths)]
    scores = logits.clone()
    going = [i for i, rule in enumerate(rules) if len(rule.processors)]
    position = 0
    while going:
        prefixes = [torch.cat([sequences[i], draft.tokens[i, :position]]) for i in going]
        processed = processed_scores([rules[i].processors for i in going], prefixes, logits[going, position])
        scores[going, position] = processed
        going = [
            i
            for n, i in enumerate(going)
            if position < lengths[i]
            and _may_accept(rules[i], scores[i, position], int(draft.tokens[i, position]), uniforms[i], position)
        ]
        position += 1
    return scores


def _own_uniforms(rule: RowRules, draft: Draft) -> bool:
    return rule.do_sample and rule.uniforms is not None and draft.probs is None


def _may_accept(rule: RowRules, scores: torch.Tensor, token: int, uniforms: list[float] | None, position: int) -> bool:
    """Whether acceptance may keep `token` at `position` given its processed scores [V] (when unsure: True)."""
    scores = scores.detach()
    if not rule.do_sample:
        value = scores[token]
        return bool(value >= scores.max()) or bool(value.isnan())  # among the maximal values: argmax may be it
    if uniforms is None:
        return True
    return choose_token(scores, uniforms[position]) == token  # what accept_by_uniforms computes from these scores
