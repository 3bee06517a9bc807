"""Adaptive drafting: draft length from recent acceptance, and no drafts while drafting does not pay.

`AdaptivePolicy` is pure bookkeeping (no model, no clock): the caller reports each verify step
(tokens drafted and accepted per row, seconds spent drafting and verifying) and asks how many
tokens to draft next.

* Draft length (`length_rule="heuristic"`, the default) follows Transformers' "heuristic" schedule for assisted generation
  (`AssistedCandidateGenerator.update_candidate_strategy` in
  `transformers/generation/candidate_generator.py`, 5.24: `num_assistant_tokens += 2` when every
  candidate matched, else `max(1, num_assistant_tokens - 1)`), bounded by `max_tokens`. With
  `length_rule="cost"` the length is instead the k with the best expected gain under the cost
  model below, once its costs are measured. Both rules assume a per-token acceptance rate; n-gram
  drafts, right in bursts, measured faster at a fixed full length (what drafter="auto" uses).
* Pausing uses a cost model measured online. With per-token acceptance a (geometric estimate,
  exponentially decayed), draft cost c_d per drafted token, plain step cost c_0 (a verify step
  without drafts) and marginal verify cost c_v per extra verified token, a step drafting k tokens
  emits E(k) = (1 - a^(k+1)) / (1 - a) tokens at cost c_0 + k (c_d + c_v). When no k up to the
  current length beats plain decoding (E(k) c_0 / cost(k) < `min_gain`), drafting pauses for
  `pause_steps` plain steps, doubling on every failed probe up to `max_pause_steps`, so a drafter
  that never pays costs at most one short probe per long pause.

`AdaptiveDrafter` wraps any Drafter with a policy and times it through the drafter interface
(propose -> on_accept spans the verify step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .drafters import Draft, Drafter, DraftSetup
from .stats import decayed_average


@dataclass
class AdaptivePolicy:
    """Draft length and pause decisions from observed acceptance and costs (all times in seconds).

    max_tokens: cap on the draft length (the loop's num_draft_tokens). initial_tokens: first
    length (default: max_tokens). decay: weight kept by old evidence per step (0.8: about the
    last 5 steps count). warmup_steps: drafting steps observed before the first pause decision.
    min_gain: expected speedup over plain decoding that drafting must reach to continue.
    prior_acceptance / prior_weight: pseudo-observations of the acceptance estimate.
    """

    max_tokens: int = 5
    initial_tokens: int | None = None
    min_tokens: int = 1
    decay: float = 0.8
    warmup_steps: int = 3
    min_gain: float = 1.0
    pause_steps: int = 4
    max_pause_steps: int = 64
    length_rule: str = "heuristic"
    prior_acceptance: float = 0.5
    prior_weight: float = 1.0
    # state
    length: int = field(init=False)
    paused_for: int = field(init=False, default=0)
    next_pause: int = field(init=False)
    drafting_steps: int = field(init=False, default=0)
    accepted_mass: float = field(init=False)
    trial_mass: float = field(init=False)
    draft_s_per_token: float | None = field(init=False, default=None)
    plain_step_s: float | None = field(init=False, default=None)
    verify_s_per_extra_token: float | None = field(init=False, default=None)
    pauses: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [1, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {self.decay!r}")
        if self.pause_steps < 1 or self.max_pause_steps < self.pause_steps:
            raise ValueError("need 1 <= pause_steps <= max_pause_steps")
        if self.length_rule not in ("heuristic", "cost"):
            raise ValueError(f"length_rule must be 'heuristic' or 'cost', got {self.length_rule!r}")
        start = self.max_tokens if self.initial_tokens is None else self.initial_tokens
        self.length = min(max(start, self.min_tokens), self.max_tokens)
        self.next_pause = self.pause_steps
        self.accepted_mass = self.prior_acceptance * self.prior_weight
        self.trial_mass = self.prior_weight

    # ---- decisions -------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self.paused_for > 0

    def draft_length(self) -> int:
        """Tokens to draft at the next step (0 while paused)."""
        return 0 if self.paused else self.length

    @property
    def acceptance(self) -> float:
        """Estimated probability that the next draft token is accepted given the previous one was."""
        return self.accepted_mass / self.trial_mass if self.trial_mass > 0 else self.prior_acceptance

    def expected_tokens(self, k: int) -> float:
        """E[tokens emitted by a step drafting k tokens] = sum_{i<=k} a^i."""
        a = min(self.acceptance, 0.999999)
        return (1.0 - a ** (k + 1)) / (1.0 - a)

    def expected_gain(self, k: int) -> float | None:
        """Expected speedup of drafting k tokens over plain decoding, or None before costs are known."""
        if self.draft_s_per_token is None or self.plain_step_s is None:
            return None
        extra = self.verify_s_per_extra_token or 0.0
        cost = self.plain_step_s + k * (self.draft_s_per_token + extra)
        return self.expected_tokens(k) * self.plain_step_s / cost if cost > 0 else None

    # ---- observations ------------------------------------------------------------------------
    def record(self, drafted: list[int], accepted: list[int], draft_s: float, verify_s: float) -> None:
        """One verify step: per row tokens drafted and accepted; seconds drafting and verifying."""
        total_drafted = sum(drafted)
        if total_drafted == 0:
            self._observe_plain(verify_s)
            if self.paused_for > 0:
                self.paused_for -= 1
            return
        self.drafting_steps += 1
        self.observe_acceptance(drafted, accepted)
        self._observe_costs(total_drafted, len(drafted), draft_s, verify_s)
        self._adapt_length(drafted, accepted)
        self._maybe_pause()

    def skip_step(self) -> None:
        """A step this policy's drafter took no part in (another source drafted): count down a pause."""
        if self.paused_for > 0:
            self.paused_for -= 1

    def _observe_plain(self, verify_s: float) -> None:
        self.plain_step_s = decayed_average(self.plain_step_s, verify_s, self.decay)

    def observe_acceptance(self, drafted: list[int], accepted: list[int]) -> None:
        """Acceptance evidence only (also for drafts scored without being verified).

        Geometric estimate: each row adds its accepted tokens as successes, and one failed trial if
        it stopped before the end of its draft.
        """
        successes = sum(accepted)
        trials = successes + sum(1 for d, n in zip(drafted, accepted) if n < d)
        self.accepted_mass = self.decay * self.accepted_mass + successes
        self.trial_mass = self.decay * self.trial_mass + trials

    def _observe_costs(self, total_drafted: int, rows: int, draft_s: float, verify_s: float) -> None:
        self.draft_s_per_token = decayed_average(self.draft_s_per_token, draft_s / total_drafted, self.decay)
        if self.plain_step_s is None:
            self.plain_step_s = verify_s  # an overestimate until a plain step is seen: favours drafting, never pauses early
        per_row_drafts = total_drafted / rows
        extra = max(0.0, verify_s - self.plain_step_s) / per_row_drafts
        self.verify_s_per_extra_token = decayed_average(self.verify_s_per_extra_token, extra, self.decay)

    def _adapt_length(self, drafted: list[int], accepted: list[int]) -> None:
        """Transformers' heuristic: +2 when every row accepted its whole draft, else -1; or, with
        length_rule="cost" and measured costs, the length with the best expected gain."""
        if self.length_rule == "cost" and self.expected_gain(self.min_tokens) is not None:
            lengths = range(self.min_tokens, self.max_tokens + 1)
            self.length = max(lengths, key=lambda k: (self.expected_gain(k), -k))
            return
        if all(n >= d for d, n in zip(drafted, accepted)):
            self.length = min(self.length + 2, self.max_tokens)
        else:
            self.length = max(self.length - 1, self.min_tokens)

    def _maybe_pause(self) -> None:
        if self.drafting_steps < self.warmup_steps:
            return
        gains = [self.expected_gain(k) for k in range(self.min_tokens, self.length + 1)]
        if any(g is None for g in gains):
            return
        if max(gains) >= self.min_gain:
            self.next_pause = self.pause_steps  # drafting pays: the next pause starts short again
            return
        self.paused_for = self.next_pause
        self.next_pause = min(2 * self.next_pause, self.max_pause_steps)
        self.pauses += 1
        self.drafting_steps = self.warmup_steps - 1  # after the pause, one probe step decides again
        self.length = self.min_tokens

    def to_dict(self) -> dict:
        """Current estimates, JSON-ready (for stats and benchmarks)."""
        return {
            "length": self.length,
            "paused_for": self.paused_for,
            "pauses": self.pauses,
            "acceptance": round(self.acceptance, 4),
            "draft_ms_per_token": None if self.draft_s_per_token is None else 1e3 * self.draft_s_per_token,
            "plain_step_ms": None if self.plain_step_s is None else 1e3 * self.plain_step_s,
            "verify_ms_per_extra_token": None if self.verify_s_per_extra_token is None else 1e3 * self.verify_s_per_extra_token,
        }


def empty_draft(batch: int, device: torch.device) -> Draft:
    """A draft of no tokens for every row (the verify step becomes a plain decode step)."""
    return Draft(
        tokens=torch.zeros(batch, 0, dtype=torch.long, device=device),
        lengths=torch.zeros(batch, dtype=torch.long, device=device),
    )


class AdaptiveDrafter:
    """Any Drafter, drafting as many tokens as its AdaptivePolicy says (none while paused).

    A paused stateful drafter (the self/assistant drafters) is not called; it catches up on the
    tokens it missed when drafting resumes.
    """

    def __init__(
        self, inner: Drafter, policy: AdaptivePolicy | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.inner = inner
        self.policy = policy or AdaptivePolicy(max_tokens=max(1, getattr(inner, "num_draft_tokens", 5)))
        self.clock = clock
        self.device = torch.device("cpu")
        self._pending: tuple[list[int], float, float, bool] | None = None  # (lengths, draft_s, draft end, inner used)

    def start(self, prompts: list[torch.Tensor], setup: DraftSetup) -> None:
        self.device = setup.device
        self._pending = None
        self.inner.start(prompts, setup)

    def propose(self, sequences: list[torch.Tensor], max_tokens: list[int]) -> Draft:
        started = self.clock()
        k = self.policy.draft_length()
        if k == 0:
            draft, used = empty_draft(len(sequences), self.device), False
        else:
            draft, used = self.inner.propose(sequences, [min(k, m) for m in max_tokens]), True
        ended = self.clock()
        self._pending = (draft.lengths.tolist(), ended - started, ended, used)
        return draft

    def on_accept(self, num_accepted: torch.Tensor) -> None:
        if self._pending is None:
            return
        lengths, draft_s, draft_end, used = self._pending
        self._pending = None
        if used:
            self.inner.on_accept(num_accepted)
        self.policy.record(lengths, num_accepted.tolist(), draft_s, self.clock() - draft_end)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.inner.select_rows(rows)

    def add_rows(self, prompts: list[torch.Tensor]) -> None:
        self.inner.add_rows(prompts)
