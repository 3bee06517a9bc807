"""DecodeEngine: requests join and leave one running speculative batch, each row exactly its own decoding.

`add(request)` prefills the request's prompt alone (continuing from the prompt cache's longest prefix when
there is one), chooses its first token, and joins the row to the running batch; `step()` runs one
draft-verify step over every live row. A row that ends (EOS, its budget, a stop string, a cancel, its
deadline) completes its request at once and leaves the batch; the others go on.

The steps are those of `generate(quasar=True)`'s own loop (`SpeculativeRun`: prefill, step, join), so
offline and served decoding cannot drift apart. Each row keeps the rules of its own request (processors,
stopping criteria, sampling, generator, draft length: row_rules.py). Its bits do not depend on the
batch: its prompt is prefilled alone, verification runs the row-stable attention (ops/rowstable_attention.py),
and rows of other requests are masked holes in its cache (row_aligned_cache.py). So a greedy row gives the tokens
it gives alone, and a sampled row with a seed the same text, whatever else is served.

With compiled steps (a static cache) the rows live in one preallocated cache of a power-of-two batch size,
moving to the next size as rows join and back as they leave (static_buffers.py): the sizes `warm_up` compiled,
so admission and completion never trace a graph. Each row is prefilled alone, as compiled plain decoding
prefills it, and its slots join right-aligned (StaticVerifierCache.join).

What the engine cannot mix waits for the batch to drain: a request whose Quasar options need another
drafter (`join_key`), and every request on a model whose cache cannot hold rows of different lengths
(sliding-window layers: one row at a time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable

import torch

from quasar_hf import compat

from .batch_request import BatchRequest, RequestRows
from .config import QuasarGenerationConfig
from .drafters import Drafter, NoDrafter, make_drafter
from .loop import SpeculativeRun
from .prompt_cache import KeyValues, PromptCache
from .row_aligned_cache import RowAlignedCache
from .static_cache import StaticVerifierCache
from .stats import QuasarStats
from .strategy import static_batch_slots
from .verify_attention import verification_attention

MIN_REUSED_TOKENS = 16  # a shorter shared prefix is prefilled again (its copy costs about what it saves)


def join_key(config: QuasarGenerationConfig) -> str:
    """Rows whose Quasar options have equal keys share one drafter: everything but the draft length (per row;
    with a static cache it fixes the verify step's width, so it is part of the key)."""
    data = config.to_dict()
    if config.cache_implementation != "static":
        data.pop("num_draft_tokens", None)
    return json.dumps(data, sort_keys=True, default=repr)


class DecodeEngine:
    """The rows decoding now and their shared verifier cache (see the module docstring). Not thread-safe: one
    worker thread calls `add` and `step`."""

    def __init__(
        self,
        model: torch.nn.Module,
        prompt_cache: PromptCache | None = None,
        on_stats: Callable[[QuasarStats, int], None] | None = None,
    ) -> None:
        """`prompt_cache`: keys and values a request continues from and each finished row leaves; `on_stats`:
        receives each prefill's and each step's counters with the rows that step decoded (0 for a prefill)."""
        self.model = model
        self.prompt_cache = prompt_cache
        self.on_stats = on_stats
        self.run: SpeculativeRun | None = None
        self.key: str | None = None  # join_key of the running rows
        self.streamer: RequestRows | None = None
        self.single_row = False  # the model's cache cannot hold rows of different lengths
        self._drafters: dict[str, Drafter] = {}  # one per join key, kept across batches (its policies keep learning)
        self._attention = contextlib.ExitStack()  # an SDPA model runs row-stable verification for the engine's life
        self._attention.enter_context(verification_attention(model))

    @property
    def rows(self) -> int:
        """Rows decoding now."""
        return 0 if self.run is None else len(self.run.active)

    @property
    def requests(self) -> list[BatchRequest]:
        return [] if self.streamer is None else list(self.streamer.requests.values())

    def can_join(self, config: QuasarGenerationConfig, request: BatchRequest | None = None) -> bool:
        """Whether a request with these options can join the running rows now (with a static cache, `request` must
        fit in the running cache)."""
        if self.rows == 0:
            return True
        if self.single_row or join_key(config) != self.key:
            return False
        verifier = self.run.verifier
        if isinstance(verifier, StaticVerifierCache) and request is not None:
            return static_batch_slots(self.model, _max_length(request), config) <= verifier.max_cache_len
        return True

    def add(self, request: BatchRequest, config: QuasarGenerationConfig) -> None:
        """Prefill `request` alone and join it to the running rows (the caller checked `can_join`). Its first token
        is streamed here; a request that ends with it is complete when this returns."""
        self.join(request, config, self.prefill(request, config, self.cached_prefix(request)))

    def cached_prefix(self, request: BatchRequest) -> KeyValues | None:
        """The prompt cache's keys and values of the longest prefix of the request's prompt (None: none long enough)."""
        if self.prompt_cache is None:
            return None
        hit = self.prompt_cache.longest_prefix(request.input_ids, MIN_REUSED_TOKENS)
        if hit is None:
            return None
        request.reused_tokens = hit.tokens
        return hit.layers

    def prefill(self, request: BatchRequest, config: QuasarGenerationConfig, prefix: KeyValues | None) -> SpeculativeRun:
        """The request's row after its prefill alone (continuing from `prefix`), its first token streamed. Reads and
        changes nothing of the running rows, so it may run in another thread while they step."""
        from .strategy import generate_with_quasar

        started = time.perf_counter()
        ids = torch.tensor([request.input_ids], dtype=torch.long, device=compat.input_device(self.model))
        with torch.no_grad():
            run = generate_with_quasar(
                self.model,
                ids,
                attention_mask=torch.ones_like(ids),  # a prompt holding the pad token id is still all prompt
                generation_config=request.runnable_config(),
                streamer=RequestRows({0: request}),
                quasar=dataclasses.replace(config, drafter=NoDrafter()),  # the batch's drafter serves it once joined
                quasar_generator=request.generator,
                tokenizer=request.tokenizer,
                quasar_prefixes=None if prefix is None else [prefix],
                quasar_admit=True,
            )
        run.rules[0].draft_limit = config.num_draft_tokens
        run.stats.prefill_time_s = time.perf_counter() - started
        return run

    def join(self, request: BatchRequest, config: QuasarGenerationConfig, run: SpeculativeRun) -> None:
        """Join a prefilled row (`prefill`) to the running rows, or start the batch with it."""
        if not self.can_join(config):
            _release(run)
            raise ValueError("this request's Quasar options cannot join the running rows; add it once they finish")
        if self.on_stats is not None:
            self.on_stats(run.stats, 0)
        run.stats = QuasarStats()
        if not run.active:
            _release(run)
            return
        if self.rows == 0:
            key = join_key(config)
            run.use_drafter(self._drafter(key, config))
            run.keep_row_cache = None if self.prompt_cache is None else self.prompt_cache.store
            self.run, self.streamer, self.key = run, run.streamer, key
            self.single_row = not _holds_ragged_rows(run.verifier)
            return
        try:
            offset = self.run.join(run)
        finally:
            _release(run)  # its keys and values are the batch's now (or the join failed)
        self.streamer.requests[offset] = request

    def step(self) -> None:
        """One draft-verify step over every live row; rows that end complete their requests."""
        if self.run is None:
            return
        rows = len(self.run.active)
        try:
            with torch.no_grad():  # inference: no autograd records (a compiled step would trace a backward)
                self.run.step()
        finally:
            if self.on_stats is not None:
                self.on_stats(self.run.stats, rows)
            self.run.stats = QuasarStats()
        if not self.run.active:
            self._end_batch()

    def fail_all(self, error: str) -> None:
        """End every running request with `error` and drop the batch (after a step failed)."""
        requests = self.requests
        self._end_batch()
        for request in requests:
            request.finish(error)

    def close(self) -> None:
        if self.run is not None:
            self._end_batch()
        self._attention.close()

    def _end_batch(self) -> None:
        if self.run is not None:
            _release(self.run)
        self.run, self.streamer, self.key = None, None, None

    def _drafter(self, key: str, config: QuasarGenerationConfig) -> Drafter:
        if key not in self._drafters:
            self._drafters[key] = make_drafter(self.model, config)
        return self._drafters[key]


def _release(run: SpeculativeRun) -> None:
    """Give a held static cache back (static_buffers.py); a dynamic cache is freed with the run."""
    if isinstance(run.verifier, StaticVerifierCache):
        run.verifier.release()


def _max_length(request: BatchRequest) -> int:
    """Prompt plus new tokens: the max_length generate gives the request's call."""
    return len(request.input_ids) + int(request.generation_config.max_new_tokens or 0)


def _holds_ragged_rows(verifier: object) -> bool:
    """Whether rows of different lengths can share this cache (masked holes need full-attention layers)."""
    if isinstance(verifier, StaticVerifierCache):
        return verifier.buffers is not None and not verifier.has_sliding_layers
    if not isinstance(verifier, RowAlignedCache):
        return False
    try:
        verifier.check_holes_supported()
    except ValueError:
        return False
    return True
