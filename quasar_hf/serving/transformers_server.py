"""`transformers serve`'s own server, with every request of a Quasar model decoded by a RequestBatcher.

This is the one module that touches `transformers.cli.serving` (its handlers, model manager and app
factory change between releases; tested with Transformers 5.24). The OpenAI-compatible endpoints,
request parsing, chat templates, streaming and tool-call parsing are Transformers' own. What changes
is the generation manager behind them: `QuasarGenerateManager` receives each request with its own
generation config (temperature, stop strings, max tokens, a `quasar` field) and queues it to one
RequestBatcher, so requests from concurrent clients decode together as one batched Quasar call,
each streamed as its tokens are accepted. A client that goes away cancels its row only.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import BaseGenerateManager, DirectStreamer, GenerationState

from quasar_hf import compat
from quasar_hf.speculative.batcher import BatchRequest, RequestBatcher


class RequestError(ValueError):
    """A request whose settings cannot run (answered with HTTP 400 and the reason)."""


def checked_generation_config(config: GenerationConfig, prompt_tokens: int, max_tokens: int | None) -> None:
    """Refuse settings no decoding can run (a 400 naming the field), before the request is queued."""
    if config.max_new_tokens is not None and config.max_new_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {config.max_new_tokens}")
    try:
        config.validate(strict=False)
    except ValueError as error:
        raise RequestError(f"invalid generation settings: {error}") from None
    if max_tokens is not None and prompt_tokens + int(config.max_new_tokens or 0) > max_tokens:
        raise RequestError(
            f"the prompt ({prompt_tokens} tokens) plus max_tokens ({config.max_new_tokens}) exceeds the "
            f"{max_tokens} tokens this server holds per request (quasar-hf serve --max-model-len)"
        )


def _http_400(error: RequestError) -> Exception:
    from fastapi import HTTPException

    return HTTPException(status_code=400, detail=str(error))


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


class QuasarGenerateManager(BaseGenerateManager):
    """Transformers serving's generation manager for a Quasar model: each request goes to the RequestBatcher."""

    def __init__(self, batcher: RequestBatcher, max_tokens: int | None = None) -> None:
        self.batcher = batcher
        self.max_tokens = max_tokens

    def _request(self, processor: Any, inputs: dict, gen_config: GenerationConfig, on_tokens, on_done) -> BatchRequest:
        ids = inputs["input_ids"]
        prompt = ids[0].tolist() if isinstance(ids, torch.Tensor) else list(ids)
        try:
            checked_generation_config(gen_config, len(prompt), self.max_tokens)
        except RequestError as error:
            raise _http_400(error) from None
        tokenizer = getattr(processor, "tokenizer", processor)
        generator = None
        if gen_config.do_sample:  # the request's seed (set just before by the handler) drives its own generator
            generator = torch.Generator().set_state(torch.get_rng_state())
            torch.randint(1 << 30, ())  # the next unseeded request gets other randomness
        request = BatchRequest(prompt, gen_config, on_tokens, on_done, tokenizer=tokenizer, generator=generator)
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
        direct = DirectStreamer(compat.rust_tokenizer(processor), loop, queue, response_parser)
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
        self.batcher.submit(request)
        return queue, _RequestStream(direct, request)

    async def generate_non_streaming(
        self, model: Any, processor: Any, inputs: dict, gen_config: GenerationConfig, request_id: str
    ) -> tuple[str, int, list[int]]:
        loop = asyncio.get_running_loop()
        finished: asyncio.Future = loop.create_future()
        tokens: list[int] = []

        def on_done(error: str | None) -> None:
            outcome = RuntimeError(f"generation failed: {error}") if error is not None else None
            loop.call_soon_threadsafe(_settle, finished, outcome)

        request = self._request(processor, inputs, gen_config, tokens.extend, on_done)
        self.batcher.submit(request)
        try:
            await finished
        except asyncio.CancelledError:
            request.cancel()
            raise
        text = processor.decode(tokens, skip_special_tokens=True)
        return text, len(request.input_ids), tokens

    def stop(self) -> None:
        self.batcher.stop()


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

    def shutdown(self) -> None:
        self.manager.stop()


def build_app(
    checkpoint: str,
    device: str = "cpu",
    max_batch_size: int = 8,
    quasar: dict | None = None,
    max_tokens: int | None = None,
    chat_template_kwargs: dict | None = None,
) -> tuple[Any, ModelManager, QuasarGenerationState]:
    """Transformers' serving app for the Quasar checkpoint folder `checkpoint` (loaded now), every request
    decoded by one RequestBatcher (`quasar`: Quasar options for every request, such as compiled steps)."""
    model_manager = ModelManager(device=device, dtype="auto", trust_remote_code=True, force_model=checkpoint)
    model, _ = model_manager.load_model_and_processor(model_manager.process_model_name(checkpoint))
    state = QuasarGenerationState(QuasarGenerateManager(RequestBatcher(model, max_batch_size, quasar=quasar), max_tokens))
    handlers = dict(model_manager=model_manager, generation_state=state)
    app = build_server(
        model_manager,
        ChatCompletionHandler(**handlers, chat_template_kwargs=chat_template_kwargs),
        completion_handler=CompletionHandler(**handlers),
        response_handler=ResponseHandler(**handlers, chat_template_kwargs=chat_template_kwargs),
        transcription_handler=TranscriptionHandler(model_manager, state),
        systemone_handler=SystemOneHandler(**handlers, chat_template_kwargs=chat_template_kwargs),
        generation_state=state,
    )
    return app, model_manager, state


def served_model(model_manager: ModelManager, checkpoint: str) -> Any:
    """The model the server holds for `checkpoint` (loaded by build_app)."""
    return model_manager.load_model_and_processor(model_manager.process_model_name(checkpoint))[0]
