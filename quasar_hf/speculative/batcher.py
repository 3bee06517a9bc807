"""RequestBatcher: concurrent requests decoded together, each row exactly its own speculative decoding.

A server hands requests to `submit` from any thread. One worker thread takes the requests waiting
when it is free (after a short gather window, so clients that send together are batched together),
groups those whose generation settings agree (everything but `max_new_tokens`), and runs each group
as one batched call of the speculative loop: left-padded prompts, one verify forward per step for
all rows, each row accepting its own drafts. Greedy rows are batched; a sampled request runs alone,
so its seed reproduces it whatever else is being served. A request with Quasar off
(`quasar: false` in its generation config) runs the same loop without drafts, which is plain
decoding; the same compiled steps serve both.

Each row streams through a RowStreamer (speculative/loop.py): its tokens go to the request's
callback as they are accepted, and the row stops at its own `max_new_tokens` or when the request is
cancelled (a client that went away), without disturbing the other rows. Where a row's batch shape
changes its bits (prefill padding), the difference is a near-tie; `benchmarks serve-load` proves it
from the logits gap.
"""

from __future__ import annotations

import copy
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from quasar_hf import compat

from .config import QuasarGenerationConfig
from .defaults import FIELD, declined_reason
from .left_padding import left_padded
from .prompt_cache import PromptCache
from .stats import QuasarStats

logger = logging.getLogger(__name__)

MAX_BATCH_SIZE = 8  # rows of one batched call (compiled steps round up to a power of two)
GATHER_SECONDS = 0.01  # how long a free worker waits for requests sent together with the first one
MIN_REUSED_TOKENS = 16  # a shorter shared prefix is prefilled again (its copy costs about what it saves)
# A batch reuses cached prefixes only when every row has one: a row without continues from nothing, which
# is a plain prefill when alone, and its bits must be the ones it gets alone.


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

    def past_deadline(self) -> bool:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.cancel("timeout")
        return self.cancelled.is_set()


SHUTTING_DOWN = "the server is shutting down"


class RequestBatcher:
    """The worker thread that batches and decodes requests for one model (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch_size: int = MAX_BATCH_SIZE,
        gather_seconds: float = GATHER_SECONDS,
        quasar: dict | None = None,
        on_call: Callable[[QuasarStats, int], None] | None = None,
        prompt_cache: PromptCache | None = None,
    ) -> None:
        """`quasar`: Quasar options the server sets for every request (compiled steps), under each request's own;
        `on_call`: receives each batched call's speculative counters and its rows (metrics); `prompt_cache`: keys and values
        of finished requests that a request decoding alone continues from."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.gather_seconds = gather_seconds
        self.quasar = quasar
        self.on_call = on_call
        self.prompt_cache = prompt_cache
        self.fatal_error: BaseException | None = None
        self.batches_run = 0
        self.rows_run = 0
        self._waiting: queue.Queue[BatchRequest | None] = queue.Queue()
        self._held: list[BatchRequest] = []
        self._running: list[BatchRequest] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._work, name="quasar-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: BatchRequest) -> BatchRequest:
        """Queue a request (from any thread); its callbacks run on the worker thread."""
        if self._stopping.is_set() or self.fatal_error is not None:
            raise RuntimeError(f"the request batcher is stopped{f': {self.fatal_error}' if self.fatal_error else ''}")
        self._waiting.put(request)
        return request

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet decoding (approximate while the worker moves them)."""
        return self._waiting.qsize() + len(self._held)

    def stop(self, timeout: float | None = 5.0) -> None:
        """End the rows decoding now (each with its tokens so far), fail the requests still waiting, end the worker."""
        self._stopping.set()
        for request in list(self._running):
            request.cancel("shutdown")
        self._waiting.put(None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ worker thread
    def _work(self) -> None:
        while not self._stopping.is_set():
            batch = self._next_batch()
            if batch:
                self._run(batch)
        for request in [*self._held, *self._drain()]:
            request.finish_reason = "shutdown"
            request.finish(SHUTTING_DOWN)

    def _next_batch(self) -> list[BatchRequest]:
        """The requests to run next: the oldest waiting one and those that batch with it."""
        if not self._held:
            first = self._waiting.get()
            if first is None:
                return []
            self._held.append(first)
            time.sleep(self.gather_seconds)
        self._held.extend(r for r in self._drain() if r is not None)
        self._held = [r for r in self._held if not self._finish_if_cancelled(r)]
        if not self._held or self._stopping.is_set():
            return []
        key = batch_key(self._held[0])
        batch = [r for r in self._held if batch_key(r) == key][: self.max_batch_size]
        self._held = [r for r in self._held if r not in batch]
        return batch

    def _drain(self) -> list[BatchRequest | None]:
        items = []
        while True:
            try:
                item = self._waiting.get_nowait()
            except queue.Empty:
                return items
            if item is None:
                self._stopping.set()
            else:
                items.append(item)

    @staticmethod
    def _finish_if_cancelled(request: BatchRequest) -> bool:
        if request.past_deadline():
            request.finish(None)
            return True
        return False

    def _run(self, batch: list[BatchRequest]) -> None:
        self._running = batch
        self.batches_run += 1
        self.rows_run += len(batch)
        for request in batch:
            if request.on_start is not None:
                request.on_start()
        try:
            stats = decode_batch(self.model, batch, self.quasar, self.prompt_cache)
            error = None
        except Exception as failure:  # a request's own fault (bad settings, a bad row) fails its batch, not the server
            logger.exception("quasar_hf: a batch of %d request(s) failed", len(batch))
            stats, error = None, f"{type(failure).__name__}: {failure}"
        except BaseException as failure:  # noqa: B036 - the worker is gone: say so to every caller
            self.fatal_error = failure
            for request in batch:
                request.finish(f"the decoding worker died: {failure!r}")
            raise
        finally:
            self._running = []
        if error is not None and len(batch) > 1 and not any(r.emitted for r in batch):
            for request in batch:  # nothing was sent yet: each request alone, so only the faulty one fails
                self._run([request])
            return
        if stats is not None and self.on_call is not None:
            self.on_call(stats, len(batch))
        for request in batch:
            request.finish(error)


def batch_key(request: BatchRequest) -> str:
    """Requests with equal keys decode in one batch: greedy ones whose settings differ only in max_new_tokens
    (a sampled request's key is its own: its randomness depends on nothing else served)."""
    if request.key is None:
        config = request.generation_config
        ignored = ("max_new_tokens", "max_length", "transformers_version")
        settings = {k: v for k, v in config.to_dict().items() if k not in ignored}
        request.key = f"sampled-{uuid.uuid4()}" if config.do_sample else json.dumps(settings, sort_keys=True, default=repr)
    return request.key


class _RowStreamer:
    """The loop's RowStreamer for one batch: row i's tokens go to batch[i], capped at its own budget and deadline;
    a row that ends completes its request at once, whatever the other rows still decode."""

    def __init__(self, batch: list[BatchRequest]) -> None:
        self.batch = batch

    def put(self, value: torch.Tensor) -> None:
        """The prompt, streamed by generate before decoding: not new tokens."""

    def put_row(self, row: int, token_ids: list[int]) -> bool:
        request = self.batch[row]
        if request.cancelled.is_set():
            return True
        token_ids = token_ids[: max(request.budget, 0)]
        if token_ids:
            request.emitted += len(token_ids)
            request.on_tokens(token_ids)
        return request.budget <= 0 or request.past_deadline()

    def end_row(self, row: int) -> None:
        """Row `row` decodes no more: its request is complete."""
        self.batch[row].finish(None)

    def end(self) -> None:
        pass


def decode_batch(
    model: torch.nn.Module, batch: list[BatchRequest], quasar: dict | None = None, prompt_cache: PromptCache | None = None
) -> QuasarStats | None:
    """One batched speculative call for `batch` (requests of one batch key), streaming every row; its counters.
    On the dynamic cache, rows continue from `prompt_cache`'s longest prefix of their prompts (when every row
    has one) and leave their own keys and values there."""
    from .strategy import generate_with_quasar

    config = _runnable(batch[0].generation_config)
    config.max_new_tokens = max(int(r.generation_config.max_new_tokens or 0) for r in batch)
    quasar_config = request_quasar_config(model, config, quasar)
    if quasar_config is None:  # options the loop does not implement: plain generate, one request at a time
        for request in batch:
            _decode_plainly(model, request)
        return None
    config.return_dict_in_generate = True
    input_ids, attention_mask = left_padded([r.input_ids for r in batch], pad_token_id(model, config), compat.input_device(model))
    prefixes, keep = None, None
    if prompt_cache is not None and quasar_config.cache_implementation != "static":
        hits = [prompt_cache.longest_prefix(r.input_ids, MIN_REUSED_TOKENS) for r in batch]
        if all(hit is not None for hit in hits):  # every row continues from the cache, or none does
            prefixes = [hit.layers for hit in hits]
            for request, hit in zip(batch, hits):
                request.reused_tokens = hit.tokens
        keep = prompt_cache.store
    with torch.no_grad():
        out = generate_with_quasar(
            model,
            input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            streamer=_RowStreamer(batch),
            quasar=quasar_config,
            quasar_generator=batch[0].generator,
            tokenizer=batch[0].tokenizer,
            quasar_prefixes=prefixes,
            quasar_keep_row_cache=keep,
        )
    return getattr(out, "quasar_stats", None)


def _runnable(config: GenerationConfig) -> GenerationConfig:
    """A copy to decode with: Transformers' continuous batching turns use_cache off; every path here keeps a cache."""
    config = copy.deepcopy(config)
    config.use_cache = True
    return config


def _decode_plainly(model: torch.nn.Module, request: BatchRequest) -> None:
    """Plain generate of one request (its options are ones the speculative loop does not implement)."""
    ids = torch.tensor([request.input_ids], dtype=torch.long, device=compat.input_device(model))
    with torch.no_grad():
        out = model.generate(
            ids, generation_config=_runnable(request.generation_config), tokenizer=request.tokenizer, quasar=False
        )
    _RowStreamer([request]).put_row(0, out[0, ids.shape[1] :].tolist())


SERVER_OPTIONS = ("compile", "cache_implementation")  # a request cannot change these: they decide what the server compiled


def request_quasar_config(
    model: torch.nn.Module, config: GenerationConfig, override: dict | None
) -> QuasarGenerationConfig | None:
    """The loop's settings for a request: the server's options (`override`), then its generation config's
    `quasar` field (else the model's); Quasar off is the loop without drafts (plain decoding). None when the
    loop declines the request's generation options."""
    if declined_reason(model, (), {"generation_config": config}) is not None:
        return None
    setting = getattr(config, FIELD, None)
    if setting is None:
        setting = getattr(model.generation_config, FIELD, None)
    options = dict(override or {})
    if setting is False:
        options["num_draft_tokens"] = 0
    elif isinstance(setting, dict):
        options.update({k: v for k, v in setting.items() if k not in SERVER_OPTIONS})
    elif setting not in (None, True):
        raise ValueError(f"generation_config.quasar must be true, false or an object of Quasar options, got {setting!r}")
    return QuasarGenerationConfig.from_value(options or True)


def pad_token_id(model: torch.nn.Module, config: GenerationConfig) -> int:
    """The id left padding uses (never read: the mask hides it), an in-vocabulary one."""
    for value in (config.pad_token_id, config.eos_token_id, model.generation_config.pad_token_id):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0
