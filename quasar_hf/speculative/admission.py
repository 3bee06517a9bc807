"""The scheduler's admission policy: which held request starts next, and whether its prefill runs beside the rows.

Shortest asked first: among the requests held at a step boundary, the one asking the fewest new tokens (its
`max_new_tokens`, what the client said it needs) is admitted first, so a short request is not queued behind
long ones that arrived with it. A request held for its fair wait goes first whatever it asks (oldest first),
so a stream of short requests never starves a long one. The fair wait is `fair_wait_s`, or, given the
scheduler's recent step time, the time of 1 / `long_ratio` of the request's asked tokens in steps, if longer:
the longest the rows that hold it (below) can take, since each has fewer tokens than that left. A fixed wait
would end the hold early where steps are slow: Qwen2.5-Coder-0.5B's 4 short rows take over a second, and with a
fixed second the long requests go first and prefill in front of them (short median 4.6-4.9x alone, against
3.08-3.09x with the scaled wait: `benchmarks/reports/admission-mix/`).

A prefill stalls every running row for its duration (a prompt is prefilled whole: a chunk over a cache would
round differently from plain `generate`). So while at least `hold_rows` running rows each have less than
1 / `long_ratio` of the tokens a held request asks left, that request waits (up to its fair wait), whatever the
other rows have left (a long request that arrived first and runs does not release the others): they
finish soon, and its prefill, and its row widening their steps, would delay all of them, where holding delays
it alone, by their short remainder. (Summing latencies: R running rows each lose a prefill P plus their
remaining n steps times the widening d; the held request loses those n steps of time s. With P ~ 50 ms,
d ~ 5 ms and s ~ 15-30 ms on 2 cores, holding pays from 2-3 rows: `hold_rows`.) A prompt with more than
`background_prefill_tokens` uncached tokens is prefilled in the prefill thread while the rows keep stepping.
8 requests at once (4 asking 16 tokens, 4 asking 256) through the scheduler in one process
(`benchmarks/serve/admission_mix.py`, reports in benchmarks/reports/admission-mix/): the short ones' median over
their time alone 1.74-1.95 on SmolLM2-135M (first come first served 3.27-3.43), 3.08-3.09 on Qwen2.5-Coder-0.5B
(4.87-4.93), whose four short prefills of about 150 ms each run one after another.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .batch_request import BatchRequest


@dataclass(frozen=True)
class AdmissionPolicy:
    """fair_wait_s: a request held this long is admitted before any other and never held (longer where steps are
    slow, unless scale_fair_wait is False); background_prefill_tokens: a prompt with more uncached tokens is
    prefilled beside running rows; long_ratio, hold_rows: a request asking more than long_ratio times the tokens
    each of at least hold_rows running rows has left waits for them."""

    fair_wait_s: float = 1.0
    scale_fair_wait: bool = True
    background_prefill_tokens: int = 256
    long_ratio: float = 4.0
    hold_rows: int = 2

    def __post_init__(self) -> None:
        if not self.fair_wait_s >= 0:
            raise ValueError(f"fair_wait_s must be >= 0 seconds, got {self.fair_wait_s}")
        if self.background_prefill_tokens < 0:
            raise ValueError(f"background_prefill_tokens must be >= 0, got {self.background_prefill_tokens}")
        if not self.long_ratio >= 1:
            raise ValueError(f"long_ratio must be >= 1, got {self.long_ratio}")
        if self.hold_rows < 1:
            raise ValueError(f"hold_rows must be >= 1, got {self.hold_rows}")

    def fair_wait(self, request: BatchRequest, step_s: float | None = None) -> float:
        """Seconds `request` may be held before it goes first: `fair_wait_s`, or its asked tokens / `long_ratio`
        steps of `step_s` seconds (the scheduler's recent step time) when that is longer (module docstring)."""
        asked = asked_tokens(request)
        if step_s is None or math.isinf(asked) or not self.scale_fair_wait:
            return self.fair_wait_s
        return max(self.fair_wait_s, asked / self.long_ratio * step_s)

    def order(self, held: Sequence[BatchRequest], now: float | None = None, step_s: float | None = None) -> list[BatchRequest]:
        """`held` in admission order: those held their fair wait or longer, oldest first; then the others by the
        tokens they ask, fewest first (oldest first among equals)."""
        now = time.monotonic() if now is None else now

        def key(request: BatchRequest) -> tuple:
            if now - request.arrived >= self.fair_wait(request, step_s):
                return (0, 0.0, request.arrived)
            return (1, asked_tokens(request), request.arrived)

        return sorted(held, key=key)

    def hold(
        self, request: BatchRequest, running_budgets: Sequence[float], now: float | None = None, step_s: float | None = None
    ) -> bool:
        """Whether `request` waits for a later step boundary although a row is free (module docstring)."""
        now = time.monotonic() if now is None else now
        if len(running_budgets) < self.hold_rows or now - request.arrived >= self.fair_wait(request, step_s):
            return False
        asked = asked_tokens(request)
        short_rows = sum(1 for left in running_budgets if asked > self.long_ratio * max(left, 1))
        return short_rows >= self.hold_rows  # rows with more left (a long one already running) do not count

    def prefill_beside_rows(self, request: BatchRequest, running_budgets: Sequence[float]) -> bool:
        """Whether `request` is prefilled in the prefill thread while rows with these tokens left keep stepping."""
        return bool(running_budgets) and len(request.input_ids) - request.reused_tokens > self.background_prefill_tokens


def asked_tokens(request: BatchRequest) -> float:
    """The new tokens a request asks for (inf when it sets no budget)."""
    asked = request.generation_config.max_new_tokens
    return math.inf if asked is None else float(asked)


def tokens_left(request: BatchRequest) -> float:
    """The tokens a running request may still emit (inf when it sets no budget)."""
    return asked_tokens(request) - request.emitted
