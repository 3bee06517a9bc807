"""How each row of a speculative batch chooses its tokens: its own processors, stopping rules, sampling and randomness.

Rows of one `generate` call share one set of rules (one generator, drawn for the batch as a whole, as
before). Rows that joined a running batch (the serving engine, speculative/engine.py) each keep the
rules of the request they came from: a greedy row takes the argmax of its own scores, and a sampled
row with its own generator draws only for itself, from its own draft only (`own_drafts`), so its
random numbers, and so its text, do not depend on what else shares the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .drafters import Draft
from .verify import greedy_accept, speculative_sample_accept


@dataclass
class OwnDraftPolicy:
    """How much a sampled row with its own drafts drafts: a function of its own past only (no clock, no other row),
    so it drafts, and draws random numbers, the same alone as in any batch. Its n-gram drafts are verified in
    full while they pay; when the decayed fraction of its drafted tokens accepted falls below `min_rate`, it
    pauses for 1, 2, 4, ... up to `max_pause` steps (plain steps), then tries again."""

    min_rate: float = 0.25
    max_pause: int = 16
    decay: float = 0.5
    rate: float = 1.0
    pause: int = 0
    misses: int = 0

    def length(self, budget: int) -> int:
        """This step's draft length (0 while paused)."""
        if self.pause > 0:
            self.pause -= 1
            return 0
        return budget

    def record(self, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens, `accepted` of them kept."""
        if drafted <= 0:
            return
        self.rate = self.decay * self.rate + (1 - self.decay) * accepted / drafted
        if self.rate >= self.min_rate:
            self.misses = 0
            return
        self.pause = min(self.max_pause, 2**self.misses)
        self.misses += 1
        self.rate = self.min_rate  # after the pause, one good draft brings it back over


@dataclass
class RowRules:
    """One row's rules, as generate prepared them for the call the row came from."""

    processors: LogitsProcessorList  # for calls on this row alone [1, ...]
    stopping: StoppingCriteriaList
    do_sample: bool
    generator: torch.Generator | None
    max_length: int  # prompt (with its left padding) + max_new_tokens
    own_drafts: bool = False  # drafts n-gram lookups of its own tokens, whatever else shares the step
    draft_limit: int | None = None  # at most this many draft tokens per step (0: Quasar off for this row)
    own_policy: OwnDraftPolicy | None = None  # when a row with its own drafts drafts (own_drafts only)

    def __post_init__(self) -> None:
        if self.own_drafts and self.own_policy is None:
            self.own_policy = OwnDraftPolicy()


def sampling_groups(rules: list[RowRules]) -> list[tuple[list[int], RowRules]]:
    """Indices of rows that choose together, in order: rows sharing a generator (one generate call) draw as one
    batch; a row with its own draft draws alone; greedy rows form one group."""
    groups: dict[object, list[int]] = {}
    for i, rule in enumerate(rules):
        key = ("own", i) if rule.own_drafts and rule.do_sample else (rule.do_sample, id(rule.generator))
        groups.setdefault(key, []).append(i)
    return [(indices, rules[indices[0]]) for indices in groups.values()]


def choose_first(rules: list[RowRules], scores: torch.Tensor) -> torch.Tensor:
    """The first token [B] of each row from its processed prefill scores [B, V]."""
    first = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    for indices, rule in sampling_groups(rules):
        index = torch.tensor(indices, device=scores.device)
        part = scores[index]
        if rule.do_sample:
            chosen = torch.multinomial(torch.softmax(part, dim=-1), 1, generator=rule.generator).squeeze(1)
        else:
            chosen = part.argmax(-1)
        first[index] = chosen
    return first


def accept(rules: list[RowRules], draft: Draft, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted [B], next_token [B]) of each row from its scores [B, k+1, V]: greedy rows keep the drafts
    their argmax agrees with; sampled rows run exact speculative sampling with their group's generator. A row
    with its own draft is cut to its own length first, so it draws as many numbers as it would alone."""
    batch = scores.shape[0]
    if _one_group(rules):
        return _accept_group(rules[0], draft.tokens, draft.probs, scores, draft.lengths)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=scores.device)
    next_token = torch.zeros(batch, dtype=torch.long, device=scores.device)
    widths = accept_widths(rules, draft)
    for indices, rule in sampling_groups(rules):
        index = torch.tensor(indices, device=scores.device)
        width = widths[indices[0]]
        probs = None if draft.probs is None else draft.probs[index, :width]
        n, token = _accept_group(rule, draft.tokens[index, :width], probs, scores[index, : width + 1], draft.lengths[index])
        num_accepted[index], next_token[index] = n, token
    return num_accepted, next_token


def accept_widths(rules: list[RowRules], draft: Draft) -> list[int]:
    """Draft positions `accept` hands each row's group (a sampled row draws one uniform for each): a row with its own
    draft is cut to its own length, other rows keep the batch's width."""
    if _one_group(rules):
        return [draft.tokens.shape[1]] * len(rules)
    lengths = draft.lengths.tolist()
    widths = [0] * len(rules)
    for indices, rule in sampling_groups(rules):
        width = max(lengths[i] for i in indices) if rule.own_drafts and rule.do_sample else draft.tokens.shape[1]
        for i in indices:
            widths[i] = width
    return widths


def _one_group(rules: list[RowRules]) -> bool:
    return len({id(rule) for rule in rules}) == 1 or len(sampling_groups(rules)) == 1


def _accept_group(
    rule: RowRules, tokens: torch.Tensor, probs: torch.Tensor | None, scores: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if not rule.do_sample:
        return greedy_accept(tokens, scores, lengths)
    return speculative_sample_accept(tokens, probs, torch.softmax(scores, dim=-1), rule.generator, lengths)
