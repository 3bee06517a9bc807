"""What `model.init_continuous_batching` returns for a Quasar model: Transformers' continuous-batching
manager interface (the part `transformers serve --continuous-batching` uses) over a RequestBatcher.

Transformers' own continuous batching runs paged attention, which the row-stable attention of a
Quasar model is not (it answered every request with HTTP 500). Here the same calls (`start`,
`add_request`, `register_result_handler`, `cancel_request`, `stop`) queue requests to a
RequestBatcher: each request joins the running batch at the next step and leaves it when it ends, each
row exact speculative decoding of its own request, streamed token by token to its result handler.

Transformers' serving passes each request's `max_new_tokens` and `eos_token_id` only; the other
settings (temperature, Quasar options) come from the generation config the manager was made with,
as they do for Transformers' own manager. `quasar-hf serve` (quasar_hf.serving) gives every request
its own settings instead.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from .batcher import MAX_BATCH_SIZE, BatchRequest, RequestBatcher


class WorkerStatus:
    """What Transformers' serving reads of a manager's background thread: its fatal error, if any."""

    def __init__(self, batcher: Callable[[], RequestBatcher | None]) -> None:
        self._batcher = batcher

    @property
    def fatal_error(self) -> BaseException | None:
        batcher = self._batcher()
        return None if batcher is None else batcher.fatal_error


class QuasarContinuousBatching:
    """Continuous batching of a Quasar model for Transformers' serving (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, generation_config: GenerationConfig, max_batch_size: int = MAX_BATCH_SIZE) -> None:
        self.model = model
        self.generation_config = copy.deepcopy(generation_config)
        self.max_batch_size = max_batch_size
        self.batcher: RequestBatcher | None = None
        self.background_thread_status = WorkerStatus(lambda: self.batcher)
        self._requests: dict[str, tuple[BatchRequest, list[int]]] = {}
        self._handlers: dict[str, tuple[Callable, asyncio.AbstractEventLoop]] = {}
        self._undelivered: dict[str, list[GenerationOutput]] = {}  # outputs of requests with no handler yet
        self._lock = threading.Lock()

    def start(self) -> None:
        if self.batcher is None or not self.batcher.is_alive:
            self.batcher = RequestBatcher(self.model, self.max_batch_size)

    def is_running(self) -> bool:
        return self.batcher is not None and self.batcher.is_alive

    def stop(self, block: bool = True, timeout: float | None = None, **kwargs: Any) -> None:
        if self.batcher is not None:
            self.batcher.stop(timeout if block else 0.0)

    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        **logit_processor_kwargs: Any,
    ) -> str:
        """Queue a request; its outputs go to the handler registered for `request_id` (every new token when
        streaming, else once at the end)."""
        if self.batcher is None:
            raise RuntimeError("call start() before add_request()")
        request_id = request_id or f"req_{uuid.uuid4().hex[:12]}"
        config = copy.deepcopy(self.generation_config)
        if max_new_tokens is not None:
            config.max_new_tokens = max_new_tokens
        if eos_token_id is not None:
            config.eos_token_id = eos_token_id
        generated: list[int] = []

        def on_tokens(tokens: list[int]) -> None:
            generated.extend(tokens)
            if streaming:
                self._deliver(request_id, list(input_ids), generated, RequestStatus.DECODING, None)

        def on_done(error: str | None) -> None:
            status = RequestStatus.FAILED if error else RequestStatus.FINISHED
            self._deliver(request_id, list(input_ids), generated, status, error)
            with self._lock:
                self._requests.pop(request_id, None)

        request = BatchRequest(list(input_ids), config, on_tokens, on_done)
        with self._lock:
            self._requests[request_id] = (request, generated)
        self.batcher.submit(request)
        return request_id

    def register_result_handler(self, request_id: str, callback: Callable) -> None:
        """Call `callback(GenerationOutput)` on the caller's event loop for each output of `request_id`
        (outputs produced before the handler was registered are handed over first, in order)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            early = self._undelivered.pop(request_id, [])
            if not any(output.is_finished() for output in early):
                self._handlers[request_id] = (callback, loop)
        for output in early:
            loop.call_soon_threadsafe(callback, output)

    def cancel_request(self, request_id: str) -> None:
        with self._lock:
            entry = self._requests.get(request_id)
        if entry is not None:
            entry[0].cancel()

    def _deliver(
        self, request_id: str, prompt: list[int], generated: list[int], status: RequestStatus, error: str | None
    ) -> None:
        output = GenerationOutput(
            request_id=request_id, prompt_ids=prompt, generated_tokens=list(generated), status=status, error=error
        )
        with self._lock:
            handler = self._handlers.get(request_id)
            if handler is None:  # Transformers' serving registers a streaming handler after add_request
                self._undelivered.setdefault(request_id, []).append(output)
            elif output.is_finished():
                self._handlers.pop(request_id, None)
        if handler is not None:
            callback, loop = handler
            loop.call_soon_threadsafe(callback, output)


def init_continuous_batching(
    model: torch.nn.Module,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: Any = None,
    workload_hints: Any = None,
    **kwargs: Any,
) -> QuasarContinuousBatching:
    """`model.init_continuous_batching(...)` of a Quasar model (bound on the instance by hf/binding.py)."""
    return QuasarContinuousBatching(model, generation_config if generation_config is not None else model.generation_config)
