"""How many of this step's draft tokens to verify: all, fewer, or none (a plain step), from measured step costs.

A verify step runs every row at the width of its longest draft (compiled steps: at the padded
draft width), so one row's draft widens the whole batch. On a few CPU cores a wide batched step
is compute-bound: SmolLM2-135M at 4 rows measured 31 ms verifying 6 tokens per row against 13 ms
for a decode step, so drafts that are rarely right (n-gram drafts on a short prompt: 8 % accepted)
made `quasar=True` 2.1x slower than plain decoding there. Each source's own pause rule cannot see
this: it prices a draft token per row, and it learns the plain step's cost only from steps where
no row drafted, which at 4 rows almost never happen.

`StepGate` prices the batch instead. It keeps the seconds of a step by (rows, width) (width 0: a
plain step), exponentially averaged, and each step picks the width w (truncating longer drafts)
with the most expected tokens per second,

    sum over rows of (1 + f_source * min(draft length, w)) / seconds(rows, w)

against plain decoding's rows / seconds(rows, 0), where f_source is the fraction of its drafted tokens
a source got accepted (exponentially averaged over tokens). Given each row's remaining token budget, it
counts instead how far the step is expected to move the batch's frontier (the most tokens a row still
has to emit; `frontier_progress`, each draft right whole or not at all): a batched call lasts until its
last row is done, and tokens a row emits ahead of the laggard only make it idle sooner, at full step
cost. SmolLM2 compiled, 4 prompts of 300 tokens: summing tokens, the
rows drifted apart (55 steps where plain decoding takes 63, with 1.96 of the 4 rows still active per
step on average), so the call spent 0.95 s in its steps against 0.70 s plain. A per-token geometric model
(AdaptivePolicy.expected_tokens) overestimates here: n-gram drafts are right in bursts, all or
nothing, and a geometric fit to bursts predicts more tokens than they give. A width whose cost is
unknown is tried once (so is a plain step, once some width was measured), and `min_gain` <= 0 turns
the gate off. Where every verify step runs one padded width (`padded_width`: a static cache's steps,
compiled or not), all widths share that cost: the choice is the whole draft or a plain step, and one
measurement prices every width. Pure bookkeeping: the caller measures the seconds and withholds the tokens; the
verifier alone decides tokens, so the output is the same whatever the gate picks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .stats import decayed_average

PRIOR_FRACTION = 0.5  # a source's accepted fraction before it drafted: one pseudo-token, half accepted


@dataclass
class StepGate:
    """Step seconds by (rows, width), and the width to verify next."""

    min_gain: float = 1.0  # expected speedup over a plain step that a draft must reach to be verified
    decay: float = 0.8  # weight kept by the old average at each new measurement
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    accepted_mass: dict[str, float] = field(default_factory=dict)  # per source, decayed accepted tokens
    drafted_mass: dict[str, float] = field(default_factory=dict)  # per source, decayed drafted tokens
    withheld_steps: int = 0  # steps verified plain although some row had a draft
    truncated_steps: int = 0  # steps verified at a width below the longest draft
    padded_width: int | None = None  # every verify step runs this width (drafts padded to it), else None

    def record(self, rows: int, width: int, seconds: float) -> None:
        """One verify step of `rows` rows at draft width `width` (0: plain) took `seconds`."""
        key = self._cost_key(rows, width)
        self.seconds[key] = decayed_average(self.seconds.get(key), seconds, self.decay)

    def observe(self, source: str, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """Rows of one step drafted by `source`: tokens drafted and accepted per row (or scored, if withheld)."""
        self.accepted_mass[source] = self.decay * self.accepted_mass.get(source, PRIOR_FRACTION) + sum(accepted)
        self.drafted_mass[source] = self.decay * self.drafted_mass.get(source, 1.0) + sum(drafted)

    def accepted_fraction(self, source: str) -> float:
        return self.accepted_mass.get(source, PRIOR_FRACTION) / self.drafted_mass.get(source, 1.0)

    def width(self, lengths: Sequence[int], sources: Sequence[str], budgets: Sequence[int] | None = None) -> int:
        """The draft width to verify, given each row's draft length and source (and, with `budgets`, the tokens
        each row may still emit: then the batch's progress is its slowest row's, see `_progress`)."""
        longest = max(lengths, default=0)
        if longest == 0 or self.min_gain <= 0:
            return longest
        rows = len(lengths)
        plain = self.seconds.get((rows, 0))
        if self._cost_key(rows, longest) not in self.seconds:
            return longest if plain is not None or not self._measured(rows) else self._withhold(0, longest)
        if plain is None:
            return self._withhold(0, longest)  # the baseline is unknown: one plain step measures it
        best, best_rate = 0, self._progress(lengths, sources, budgets, 0) / plain * self.min_gain
        for w in range(1, longest + 1):
            cost = self.seconds.get(self._cost_key(rows, w))
            if cost is None:
                continue
            rate = self._progress(lengths, sources, budgets, w) / cost
            if rate > best_rate:
                best, best_rate = w, rate
        return self._withhold(best, longest)

    def _progress(self, lengths: Sequence[int], sources: Sequence[str], budgets: Sequence[int] | None, w: int) -> float:
        """Expected progress of one step at width w: without budgets the tokens all rows emit, with them the
        frontier's (`frontier_progress`)."""
        drafted = [min(n, w) for n in lengths]
        accept = [self.accepted_fraction(s) if k else 0.0 for k, s in zip(drafted, sources)]
        if budgets is None:
            return sum(1.0 + p * k for p, k in zip(accept, drafted))
        return frontier_progress(budgets, drafted, accept)

    def _cost_key(self, rows: int, width: int) -> tuple[int, int]:
        """Where a step's seconds are kept: a padded step costs its padded width whatever the draft's."""
        return (rows, self.padded_width if width and self.padded_width else width)

    def _measured(self, rows: int) -> bool:
        return any(r == rows and w > 0 for r, w in self.seconds)

    def _withhold(self, width: int, longest: int) -> int:
        if width == 0:
            self.withheld_steps += 1
        elif width < longest:
            self.truncated_steps += 1
        return width

    def to_dict(self) -> dict:
        """JSON-ready: the steps withheld or truncated, and the step costs in ms."""
        return {
            "withheld_steps": self.withheld_steps,
            "truncated_steps": self.truncated_steps,
            "accepted_fraction": {s: round(self.accepted_fraction(s), 4) for s in sorted(self.drafted_mass)},
            "step_ms": {f"{r}x{w}": round(1e3 * s, 3) for (r, w), s in sorted(self.seconds.items())},
        }


def frontier_progress(budgets: Sequence[int], drafted: Sequence[int], accept: Sequence[float]) -> float:
    """Expected drop of max_b(budget_b) over one step in which row b emits 1 + drafted_b tokens with probability
    accept_b, else 1 (drafts right in bursts, all or nothing, rows independent): max(budgets) - E[max_b X_b] with
    X_b = budget_b - 1 - drafted_b * Bernoulli(accept_b), from the product of the rows' distribution functions.
    Summing each row's expected tokens instead overestimates it: the slowest row sets the pace."""
    rows = [(b - 1, b - 1 - k, p) for b, k, p in zip(budgets, drafted, accept)]  # (rejected, accepted, p)
    expected, below = 0.0, 0.0
    for value in sorted({v for rejected, accepted, _ in rows for v in (rejected, accepted)}):
        cdf = 1.0
        for rejected, accepted, p in rows:
            cdf *= 1.0 if value >= rejected else p if value >= accepted else 0.0
        expected += value * (cdf - below)
        below = cdf
    return max(budgets) - expected
