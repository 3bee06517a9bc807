"""`transformers serve`'s own OpenAI app, with every request of a Quasar model decoded by a RequestBatcher.

This is the one module that builds on `transformers.cli.serving` (its handlers, model manager and app
factory change between releases; tested with Transformers 5.24), imported through
compat/transformers_serving_app.py. The OpenAI-compatible endpoints,
chat templates, streaming and tool-call parsing are Transformers' own. What changes:
- each handler first checks the request body (`request_checks`: 400 naming the field, never a 500)
  and applies OpenAI's sampling rule (a positive temperature samples);
- the generation manager behind them, `QuasarGenerateManager`, gives each request a token budget
  within the context, a seeded generator when it samples, a deadline, and a place in the queue (429
  past `max_queued`), and queues it to one RequestBatcher, where it joins the running batch at the next step, each
  streamed as its tokens are accepted and completed as soon as its own row ends;
- stop strings are cut from the text, as OpenAI's API does;
- the model manager loads only the served checkpoint, with remote code off unless the operator allows it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import torch
from transformers import GenerationConfig

from quasar_hf import compat
from quasar_hf.compat.transformers_serving_app import (
    BaseGenerateManager,
    ChatCompletionHandler,
    CompletionHandler,
    DirectStreamer,
    GenerationState,
    ModelManager,
    ResponseHandler,
    SystemOneHandler,
    TranscriptionHandler,
    build_server,
)
from quasar_hf.speculative.batcher import SHUTTING_DOWN, BatchRequest, RequestBatcher
from quasar_hf.speculative.prompt_cache import PromptCache

from .metrics import ServingMetrics
from .request_checks import SEED_FIELD, RequestError, apply_sampling, asks_max_tokens, check_body, token_budget
from .stop_text import StopTextFilter, cut_at_stop

logger = logging.getLogger(__name__)
ENDED_EARLY = ("timeout", "shutdown")  # rows cut short by the server: their responses say finish_reason "length"


def _http_error(status: int, message: str, headers: dict | None = None) -> Exception:
    from fastapi import HTTPException

    return HTTPException(status_code=status, detail=message, headers=headers)


class _CheckedRequests:
    """Put before a Transformers handler class: the body is checked first, and sampling follows OpenAI's rule."""

    endpoint = ""
    metrics: ServingMetrics

    async def handle_request(self, body: dict, request_id: str) -> Any:
        try:
            check_body(body, self.endpoint)
            return await super().handle_request(body, request_id)
        except RequestError as error:
            self.metrics.failed.labels("invalid").inc()
            raise _http_error(400, str(error)) from None
        except (ValueError, TypeError, KeyError) as error:  # the chat template or tokenizer refused this input
            self.metrics.failed.labels("invalid").inc()
            raise _http_error(400, f"the request could not be prepared: {type(error).__name__}: {error}") from None

    def _build_generation_config(self, body: dict, model_generation_config: GenerationConfig, use_cb: bool = False):
        choice = check_body(body, self.endpoint)
        unseeded = {k: v for k, v in body.items() if k != "seed"}  # the seed drives the request's own generator
        config = super()._build_generation_config(unseeded, model_generation_config, use_cb=use_cb)
        if not asks_max_tokens(body):
            config.max_new_tokens = None  # the manager gives it what the context leaves
        return apply_sampling(config, choice)


class QuasarChatHandler(_CheckedRequests, ChatCompletionHandler):
    endpoint = "chat"


class QuasarCompletionHandler(_CheckedRequests, CompletionHandler):
    endpoint = "completions"


class QuasarResponseHandler(_CheckedRequests, ResponseHandler):
    endpoint = "responses"


class _RequestStream:
    """What the handlers read of a streaming request: its token count, and `cancel()` for a client gone."""

    def __init__(self, direct: DirectStreamer, request: BatchRequest) -> None:
        self.direct = direct
        self.request = request

    @property
    def total_tokens(self) -> int:
        return self.direct.total_tokens

    def cancel(self) -> None:
        self.direct.cancel()
        self.request.cancel()


class _StopCutQueue:
    """The queue DirectStreamer fills, with stop strings cut from the text on its way to the handler's queue."""

    def __init__(self, queue: asyncio.Queue, stop_strings: Any) -> None:
        self.queue = queue
        self.cut = StopTextFilter(stop_strings)

    def put_nowait(self, item: Any) -> None:
        if type(item) is str:
            item = self.cut.feed(item)
            if item:
                self.queue.put_nowait(item)
            return
        if item is None:
            rest = self.cut.finish()
            if rest:
                self.queue.put_nowait(rest)
        self.queue.put_nowait(item)


class QuasarGenerateManager(BaseGenerateManager):
    """Transformers serving's generation manager for a Quasar model: each request goes to the RequestBatcher."""

    def __init__(
        self,
        batcher: RequestBatcher,
        context_tokens: int,
        metrics: ServingMetrics,
        max_queued: int | None = None,
        request_timeout: float | None = None,
    ) -> None:
        self.batcher = batcher
        self.context_tokens = context_tokens
        self.metrics = metrics
        self.max_queued = max_queued
        self.request_timeout = request_timeout
        self.stopping = False

    def _request(self, processor: Any, inputs: dict, gen_config: GenerationConfig, on_tokens, on_done) -> BatchRequest:
        """A checked BatchRequest (4xx/503 when it cannot be queued), its metrics wired in."""
        ids = inputs["input_ids"]
        prompt = ids[0].tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if self.stopping:
            raise _http_error(503, SHUTTING_DOWN, {"Retry-After": "5"})
        if self.max_queued is not None and self.batcher.waiting >= self.max_queued:
            self.metrics.failed.labels("queue_full").inc()
            retry = 1 + self.batcher.waiting // self.batcher.max_batch_size
            raise _http_error(
                429,
                f"{self.batcher.waiting} requests are waiting (--max-queued {self.max_queued}); retry",
                {"Retry-After": str(retry)},
            )
        gen_config.max_new_tokens = token_budget(len(prompt), gen_config.max_new_tokens, self.context_tokens)
        seed = getattr(gen_config, SEED_FIELD, None)
        if hasattr(gen_config, SEED_FIELD):
            delattr(gen_config, SEED_FIELD)
        generator = None
        if gen_config.do_sample:  # its own randomness: the text depends on nothing else served
            generator = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        metrics, tokenizer = self.metrics, getattr(processor, "tokenizer", processor)

        def started() -> None:
            metrics.waiting.dec()
            metrics.running.inc()
            metrics.queue_wait.observe(time.monotonic() - request.arrived)
            metrics.prompt_tokens.inc(len(prompt))
            request.on_start = None

        def counted_tokens(tokens: list[int]) -> None:
            metrics.generated_tokens.inc(len(tokens))
            on_tokens(tokens)

        def done(error: str | None) -> None:
            (metrics.waiting if request.on_start is not None else metrics.running).dec()
            metrics.latency.observe(time.monotonic() - request.arrived)
            if request.reused_tokens:
                metrics.cache_hits.inc()
                metrics.cache_tokens.inc(request.reused_tokens)
            if self.batcher.prompt_cache is not None:
                metrics.cache_bytes.set(self.batcher.prompt_cache.bytes)
            logger.info(
                "%d prompt tokens, %d from the prompt cache (%.0f %%), %d generated, %s",
                len(prompt),
                request.reused_tokens,
                100 * request.reused_tokens / len(prompt),
                request.emitted,
                error or request.finish_reason,
            )
            if error is None:
                metrics.finished.labels(request.finish_reason or "stop").inc()
            else:
                metrics.failed.labels("shutdown" if error == SHUTTING_DOWN else "error").inc()
            if request.finish_reason in ENDED_EARLY and error is None:
                gen_config.max_new_tokens = request.emitted  # the handlers then report finish_reason "length"
            on_done(error)

        request = BatchRequest(prompt, gen_config, counted_tokens, done, tokenizer=tokenizer, generator=generator)
        request.deadline, request.on_start = deadline, started
        metrics.waiting.inc()
        return request

    def generate_streaming(
        self,
        model: Any,
        processor: Any,
        inputs: dict,
        gen_config: GenerationConfig,
        request_id: str,
        response_parser: Any = None,
    ) -> tuple[asyncio.Queue, _RequestStream]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        target = _StopCutQueue(queue, gen_config.stop_strings) if gen_config.stop_strings else queue
        direct = DirectStreamer(compat.rust_tokenizer(processor), loop, target, response_parser)
        direct.put(inputs["input_ids"])  # DirectStreamer skips its first put: the prompt

        def on_tokens(tokens: list[int]) -> None:
            try:
                direct.put(torch.tensor(tokens))
            except Exception:  # cancelled (the client went away): stop this row
                request.cancel()

        def on_done(error: str | None) -> None:
            if error is not None:
                loop.call_soon_threadsafe(queue.put_nowait, compat.serving_stream_error(error))
            else:
                direct.end()

        request = self._request(processor, inputs, gen_config, on_tokens, on_done)
        self._submit(request)
        return queue, _RequestStream(direct, request)

    async def generate_non_streaming(
        self, model: Any, processor: Any, inputs: dict, gen_config: GenerationConfig, request_id: str
    ) -> tuple[str, int, list[int]]:
        loop = asyncio.get_running_loop()
        finished: asyncio.Future = loop.create_future()
        tokens: list[int] = []

        def on_done(error: str | None) -> None:
            if error is None:
                outcome = None
            elif error == SHUTTING_DOWN:
                outcome = _http_error(503, SHUTTING_DOWN, {"Retry-After": "5"})
            else:
                outcome = RuntimeError(f"generation failed: {error}")
            loop.call_soon_threadsafe(_settle, finished, outcome)

        request = self._request(processor, inputs, gen_config, tokens.extend, on_done)
        self._submit(request)
        try:
            await finished
        except asyncio.CancelledError:  # the client went away: its row stops at the next step
            request.cancel()
            raise
        text = cut_at_stop(processor.decode(tokens, skip_special_tokens=True), gen_config.stop_strings)
        return text, len(request.input_ids), tokens

    def _submit(self, request: BatchRequest) -> None:
        try:
            self.batcher.submit(request)
        except RuntimeError as error:
            request.finish_reason = "shutdown"
            request.finish(SHUTTING_DOWN)
            raise _http_error(503, str(error), {"Retry-After": "5"}) from None

    def stop(self) -> None:
        """Refuse new requests, end the running rows with their tokens so far, fail the waiting ones (503)."""
        self.stopping = True
        self.batcher.stop(timeout=0.0)


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if not future.done():
        future.set_exception(error) if error is not None else future.set_result(None)


class QuasarGenerationState(GenerationState):
    """Transformers serving's shared state, with one QuasarGenerateManager for the served model."""

    def __init__(self, manager: QuasarGenerateManager) -> None:
        super().__init__(continuous_batching=False)
        self.manager = manager

    def use_continuous_batching(self, model: Any, modality: Any) -> bool:
        return False  # the manager batches; requests arrive as tensors with their own generation config

    def get_manager(self, model_id: str, use_cb: bool = False) -> BaseGenerateManager:
        return self.manager

    def is_cb_alive(self) -> bool:
        return self.manager.batcher.is_alive

    def shutdown(self) -> None:
        self.manager.stop()


def context_tokens(model: Any, max_model_len: int | None, default: int | None = None) -> int:
    """Tokens one request may hold (prompt plus new): `max_model_len`, else the model's context (capped at
    `default` when given: a compiled cache's size)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    context = getattr(config, "max_position_embeddings", None)
    if max_model_len is None and default is not None:
        max_model_len = default if context is None else min(default, int(context))
    if max_model_len is not None and context is not None and max_model_len > context:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context of {context} tokens; lower it")
    if max_model_len is None and context is None:
        raise ValueError("the model's config has no max_position_embeddings: pass --max-model-len")
    return int(max_model_len if max_model_len is not None else context)


def build_app(
    checkpoint: str,
    device: str = "cpu",
    max_batch_size: int = 8,
    quasar: dict | None = None,
    max_model_len: int | None = None,
    default_model_len: int | None = None,
    chat_template_kwargs: dict | None = None,
    metrics: ServingMetrics | None = None,
    max_queued: int | None = None,
    request_timeout: float | None = None,
    trust_remote_code: bool = False,
    prompt_cache_bytes: int = 0,
) -> tuple[Any, Any, QuasarGenerationState]:
    """Transformers' serving app for the Quasar checkpoint folder `checkpoint` (loaded now), every request
    decoded by one RequestBatcher; returns (app, model, state). `quasar`: Quasar options for every request
    (compiled steps); `prompt_cache_bytes`: the prompt cache's budget (0: none)."""
    metrics = metrics or ServingMetrics()
    model_manager = ModelManager(
        device=device, dtype="auto", trust_remote_code=trust_remote_code, force_model=checkpoint, model_timeout=-1
    )
    model, _ = model_manager.load_model_and_processor(model_manager.process_model_name(checkpoint))
    prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
    batcher = RequestBatcher(model, max_batch_size, quasar=quasar, on_call=metrics.record_call, prompt_cache=prompt_cache)
    manager = QuasarGenerateManager(
        batcher, context_tokens(model, max_model_len, default_model_len), metrics, max_queued, request_timeout
    )
    state = QuasarGenerationState(manager)
    handlers = dict(model_manager=model_manager, generation_state=state)
    chat, completion, response = (
        QuasarChatHandler(**handlers, chat_template_kwargs=chat_template_kwargs),
        QuasarCompletionHandler(**handlers),
        QuasarResponseHandler(**handlers, chat_template_kwargs=chat_template_kwargs),
    )
    for handler in (chat, completion, response):
        handler.metrics = metrics
    app = build_server(
        model_manager,
        chat,
        completion_handler=completion,
        response_handler=response,
        transcription_handler=TranscriptionHandler(model_manager, state),
        systemone_handler=SystemOneHandler(**handlers, chat_template_kwargs=chat_template_kwargs),
        generation_state=state,
    )
    return app, model, state
