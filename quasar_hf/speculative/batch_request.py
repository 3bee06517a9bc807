"""One request of the serving scheduler and the streamer that routes each row's tokens to its request.

`BatchRequest` carries a request's prompt, settings and callbacks from the HTTP side to the decoding
worker; `RequestRows` is the speculative loop's RowStreamer (loop.py) over such requests: a row's tokens
go to its request, capped at its own budget and deadline, and a row that ends completes its request at once.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig


@dataclass
class BatchRequest:
    """One request: its prompt, its settings, and where its tokens go (callbacks run on the worker thread).

    on_tokens(token_ids) receives each batch of new tokens; on_done(error) ends it once (None: success),
    as soon as its own row ends. `finish_reason` says why it ended: "stop" (EOS, a stop string, its
    budget), "cancelled" (the client went away), "timeout" (past `deadline`, a time.monotonic()
    value), "shutdown" (the server stopping), "error"."""

    input_ids: list[int]
    generation_config: GenerationConfig
    on_tokens: Callable[[list[int]], None]
    on_done: Callable[[str | None], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    tokenizer: Any = None  # stop strings need it
    generator: torch.Generator | None = None  # a sampled request's randomness (seeded by the caller)
    emitted: int = 0
    key: str | None = None  # batch_key, computed once
    deadline: float | None = None
    on_start: Callable[[], None] | None = None  # called once when its batch starts decoding
    finish_reason: str | None = None
    reused_tokens: int = 0  # prompt tokens whose keys and values came from the prompt cache
    arrived: float = field(default_factory=time.monotonic)
    _finished: bool = field(default=False, init=False, repr=False)

    def cancel(self, reason: str = "cancelled") -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
        self.cancelled.set()

    @property
    def budget(self) -> int:
        return int(self.generation_config.max_new_tokens or 0) - self.emitted

    def finish(self, error: str | None = None) -> None:
        """End the request once: its callback hears the error (None: success)."""
        if self._finished:
            return
        self._finished = True
        if self.finish_reason is None:
            self.finish_reason = "error" if error is not None else "stop"
        self.on_done(error)

    def runnable_config(self) -> GenerationConfig:
        """A copy of its settings to decode with: Transformers' continuous batching turns use_cache off; every
        path here keeps a cache."""
        config = copy.deepcopy(self.generation_config)
        config.use_cache = True
        return config

    def past_deadline(self) -> bool:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.cancel("timeout")
        return self.cancelled.is_set()


class RequestRows:
    """The loop's RowStreamer for requests by row index (rows may join later: add them to `requests`)."""

    def __init__(self, requests: dict[int, BatchRequest]) -> None:
        self.requests = requests

    def put(self, value: torch.Tensor) -> None:
        """The prompt, streamed by generate before decoding: not new tokens."""

    def put_row(self, row: int, token_ids: list[int]) -> bool:
        request = self.requests[row]
        if request.cancelled.is_set():
            return True
        token_ids = token_ids[: max(request.budget, 0)]
        if token_ids:
            request.emitted += len(token_ids)
            request.on_tokens(token_ids)
        return request.budget <= 0 or request.past_deadline()

    def end_row(self, row: int) -> None:
        """Row `row` decodes no more: its request is complete."""
        self.requests.pop(row).finish(None)

    def end(self) -> None:
        pass
