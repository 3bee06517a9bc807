"""QuasarStats: what one speculative generation did (acceptance and where the time went)."""

from __future__ import annotations

from dataclasses import dataclass, field

_SUMMED = (
    "verify_steps",
    "drafted_tokens",
    "accepted_tokens",
    "new_tokens",
    "prefill_tokens",
    "draft_time_s",
    "verify_time_s",
    "forward_time_s",
    "verifier_forwards",
    "prefill_time_s",
    "total_time_s",
)


def decayed_average(old: float | None, new: float, decay: float) -> float:
    """An exponential moving average: `new` at the first measurement (old None), else `decay` of `old`
    plus the rest of `new` (the cost and timing estimates of speculative steps)."""
    return new if old is None else decay * old + (1.0 - decay) * new


@dataclass
class QuasarStats:
    """Counters of one `speculative_generate` call, summed over batch rows.

    verify_steps counts (row, verifier step) pairs after the prefill, so that
    mean_acceptance_length = new tokens / verify steps is the paper's L per sequence
    (the prefill's first token is not counted as a new token of a verify step).
    """

    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    new_tokens: int = 0
    prefill_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0  # each step's verifier forward, acceptance, emission and rollback
    forward_time_s: float = 0.0  # of which the verifier forwards (on CUDA: until the launches return)
    verifier_forwards: int = 0  # verifier forwards after the prefill (one per step for the whole batch)
    prefill_time_s: float = 0.0
    total_time_s: float = 0.0

    def record_step(self, draft_lengths: list[int], accepted: list[int], emitted: list[int]) -> None:
        """Add one verifier step: per row the drafted, accepted and emitted token counts."""
        for drafted, kept, new in zip(draft_lengths, accepted, emitted):
            self.verify_steps += 1
            self.drafted_tokens += drafted
            self.accepted_tokens += kept
            self.new_tokens += new
            self.ensure_positions(drafted)
            for position in range(drafted):
                self.drafted_per_position[position] += 1
                self.accepted_per_position[position] += int(position < kept)

    def ensure_positions(self, size: int) -> None:
        """Extend the per-position counters to at least `size` positions."""
        while len(self.drafted_per_position) < size:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)

    @property
    def mean_acceptance_length(self) -> float:
        """L = tokens emitted by verify steps / verify steps (1.0 = no draft ever accepted)."""
        return self.new_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def loop_time_per_step_s(self) -> float:
        """The loop's own time per step: drafting, acceptance, emission and rollback, without the forward."""
        return (self.draft_time_s + self.verify_time_s - self.forward_time_s) / max(1, self.verifier_forwards)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft token i accepted | it was drafted), i = 0 .. num_draft_tokens - 1."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @classmethod
    def total(cls, parts: list[QuasarStats]) -> QuasarStats:
        """The counters of several runs summed (per-position counts aligned at position 0)."""
        total = cls()
        for part in parts:
            for name in _SUMMED:
                setattr(total, name, getattr(total, name) + getattr(part, name))
            total.ensure_positions(len(part.drafted_per_position))
            for i, (drafted, accepted) in enumerate(zip(part.drafted_per_position, part.accepted_per_position)):
                total.drafted_per_position[i] += drafted
                total.accepted_per_position[i] += accepted
        return total

    @classmethod
    def from_dict(cls, data: dict) -> QuasarStats:
        """Back from `to_dict()` (derived rates are recomputed, not read)."""
        stats = cls(**{name: data[name] for name in _SUMMED if name in data})
        stats.drafted_per_position = list(data.get("drafted_per_position", []))
        stats.accepted_per_position = list(data.get("accepted_per_position", []))
        return stats

    def summary(self) -> dict:
        """The rates a benchmark reports: L, acceptance (overall and per position), time per step and per draft token."""
        steps = max(1, self.verify_steps)
        return {
            "verify_steps": self.verify_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "time_per_verify_step_s": self.verify_time_s / steps,
            "time_per_draft_token_s": self.draft_time_s / max(1, self.drafted_tokens),
            "forward_time_per_step_s": self.forward_time_s / max(1, self.verifier_forwards),
            "loop_time_per_step_s": self.loop_time_per_step_s,
        }

    def to_dict(self) -> dict:
        """All counters plus the derived rates, JSON-ready."""
        return {
            "verify_steps": self.verify_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "new_tokens": self.new_tokens,
            "prefill_tokens": self.prefill_tokens,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s,
            "forward_time_s": self.forward_time_s,
            "verifier_forwards": self.verifier_forwards,
            "loop_time_per_step_s": self.loop_time_per_step_s,
            "prefill_time_s": self.prefill_time_s,
            "total_time_s": self.total_time_s,
        }
