"""The scheduler's admission policy: which held request starts next, and whether its prefill runs beside the rows.

Shortest asked first: among the requests held at a step boundary, the one asking the fewest new tokens (its
`max_new_tokens`, what the client said it needs) is admitted first, so a short request is not queued behind
long ones that arrived with it. A request held for `fair_wait_s` goes first whatever it asks (oldest first),
so a stream of short requests never starves a long one.

A prefill stalls every running row for its duration (a prompt is prefilled whole: a chunk over a cache would
round differently from plain `generate`). So while rows run, a request is prefilled in the prefill thread, the
running rows stepping meanwhile, when its prompt has many uncached tokens, or when it asks for many times the
tokens any running row has left: those rows finish soon, and holding all of them for a request that decodes
far longer than they do costs them more than the request gains by starting one step sooner.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .batch_request import BatchRequest


@dataclass(frozen=True)
class AdmissionPolicy:
    """fair_wait_s: a request held this long is admitted before shorter ones; background_prefill_tokens: a prompt
    with more uncached tokens is prefilled beside running rows; long_ratio: so is a request asking more than this
    many times the tokens the running rows have left."""

    fair_wait_s: float = 1.0
    background_prefill_tokens: int = 256
    long_ratio: float = 4.0

    def __post_init__(self) -> None:
        if not self.fair_wait_s >= 0:
            raise ValueError(f"fair_wait_s must be >= 0 seconds, got {self.fair_wait_s}")
        if self.background_prefill_tokens < 0:
            raise ValueError(f"background_prefill_tokens must be >= 0, got {self.background_prefill_tokens}")
        if not self.long_ratio >= 1:
            raise ValueError(f"long_ratio must be >= 1, got {self.long_ratio}")

    def order(self, held: Sequence[BatchRequest], now: float | None = None) -> list[BatchRequest]:
        """`held` in admission order: those held `fair_wait_s` or longer, oldest first; then the others by the
        tokens they ask, fewest first (oldest first among equals)."""
        now = time.monotonic() if now is None else now

        def key(request: BatchRequest) -> tuple:
            if now - request.arrived >= self.fair_wait_s:
                return (0, 0.0, request.arrived)
            return (1, asked_tokens(request), request.arrived)

        return sorted(held, key=key)

    def prefill_beside_rows(self, request: BatchRequest, running_budgets: Sequence[int]) -> bool:
        """Whether `request` is prefilled in the prefill thread while rows with these tokens left keep stepping."""
        if not running_budgets:
            return False  # nothing to stall: prefill it now
        if len(request.input_ids) - request.reused_tokens > self.background_prefill_tokens:
            return True
        return asked_tokens(request) > self.long_ratio * max(max(running_budgets), 1)


def asked_tokens(request: BatchRequest) -> float:
    """The new tokens a request asks for (inf when it sets no budget)."""
    asked = request.generation_config.max_new_tokens
    return math.inf if asked is None else float(asked)
