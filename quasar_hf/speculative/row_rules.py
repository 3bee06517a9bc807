"""How each row of a speculative batch chooses its tokens: its own processors, stopping rules, sampling and randomness.

Rows of one `generate` call share one set of rules (one generator, drawn for the batch as a whole, as
before). Rows that joined a running batch (the serving engine, speculative/engine.py) each keep the
rules of the request they came from: a greedy row takes the argmax of its own scores, and a sampled
row chooses each token with the uniform of that token's index from its own generator (token_uniforms.py),
so its text does not depend on what else shares the step or on what was drafted for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .drafters import Draft
from .token_uniforms import TokenUniforms, accept_by_uniforms, choose_token
from .verify import greedy_accept, sample_rows, speculative_sample_accept


@dataclass
class RowRules:
    """One row's rules, as generate prepared them for the call the row came from."""

    processors: LogitsProcessorList  # for calls on this row alone [1, ...]
    stopping: StoppingCriteriaList
    do_sample: bool
    generator: torch.Generator | None
    max_length: int  # prompt (with its left padding) + max_new_tokens
    draft_limit: int | None = None  # at most this many draft tokens per step (0: Quasar off for this row)
    uniforms: TokenUniforms | None = None  # a sampled row of its own: each token's uniform by its index


def sampling_groups(rules: list[RowRules]) -> list[tuple[list[int], RowRules]]:
    """Indices of rows that choose together, in order: rows sharing a generator (one generate call) draw as one
    batch; a row with its own uniforms chooses alone; greedy rows form one group."""
    groups: dict[object, list[int]] = {}
    for i, rule in enumerate(rules):
        key = ("own", i) if rule.uniforms is not None and rule.do_sample else (rule.do_sample, id(rule.generator))
        groups.setdefault(key, []).append(i)
    return [(indices, rules[indices[0]]) for indices in groups.values()]


def choose_first(rules: list[RowRules], scores: torch.Tensor) -> torch.Tensor:
    """The first token [B] of each row from its processed prefill scores [B, V]."""
    first = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    for indices, rule in sampling_groups(rules):
        index = torch.tensor(indices, device=scores.device)
        part = scores[index]
        if rule.do_sample and rule.uniforms is not None:
            chosen = torch.tensor([choose_token(part[0], rule.uniforms.peek(1)[0])], device=scores.device)
            rule.uniforms.advance(1)
        elif rule.do_sample:
            chosen = sample_rows(torch.softmax(part, dim=-1), rule.generator)
        else:
            chosen = part.argmax(-1)
        first[index] = chosen
    return first


def accept(
    rules: list[RowRules], draft: Draft, scores: torch.Tensor, lengths: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted [B], next_token [B]) of each row from its scores [B, k+1, V]: greedy rows keep the drafts
    their argmax agrees with; a sampled row with its own uniforms keeps the drafts they choose; other sampled rows
    run exact speculative sampling with their group's generator. `lengths`: draft.lengths as a list, when the
    caller has read it."""
    batch = scores.shape[0]
    if _one_group(rules) and rules[0].uniforms is None:
        return _accept_group(rules[0], draft.tokens, draft.probs, scores, draft.lengths)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=scores.device)
    next_token = torch.zeros(batch, dtype=torch.long, device=scores.device)
    lengths = draft.lengths.tolist() if lengths is None else lengths  # the caller's host copy: no second sync
    for indices, rule in sampling_groups(rules):
        if rule.do_sample and rule.uniforms is not None:  # a group of one row
            i = indices[0]
            if draft.probs is not None:
                raise ValueError("a sampled row with its own uniforms takes deterministic drafts only")
            n, token = accept_by_uniforms(rule.uniforms, draft.tokens[i, : lengths[i]].tolist(), scores[i])
            num_accepted[i], next_token[i] = n, token
            continue
        index = torch.tensor(indices, device=scores.device)
        probs = None if draft.probs is None else draft.probs[index]
        n, token = _accept_group(rule, draft.tokens[index], probs, scores[index], draft.lengths[index])
        num_accepted[index], next_token[index] = n, token
    return num_accepted, next_token


def _one_group(rules: list[RowRules]) -> bool:
    return len({id(rule) for rule in rules}) == 1 or len(sampling_groups(rules)) == 1


def _accept_group(
    rule: RowRules, tokens: torch.Tensor, probs: torch.Tensor | None, scores: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if not rule.do_sample:
        return greedy_accept(tokens, scores, lengths)
    return speculative_sample_accept(tokens, probs, torch.softmax(scores, dim=-1), rule.generator, lengths)
