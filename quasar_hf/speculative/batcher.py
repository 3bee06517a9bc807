"""RequestBatcher: the serving scheduler. Requests join and leave one running batch at every step.

A server hands requests to `submit` from any thread. One worker thread loops: at each step boundary it
admits the requests waiting, in the order of its admission policy (speculative/admission.py: fewest asked
tokens first, any request held its fair wait oldest first), up to `max_batch_size` rows, each prefilled alone and joined
to the running batch (speculative/engine.py); then it runs one draft-verify step over every row. A row
that ends completes its request at once and frees its place for the next one, so a short request never
waits for a long one, and a request that arrives while others decode starts at the next step.

Greedy and sampled rows, rows with different temperatures, penalties, stop strings, draft lengths or
Quasar off (`quasar: false`: no drafts, which is plain decoding) share a step; each row decodes exactly
as it would alone (a sampled row from its own generator). A request the running rows cannot take (other
Quasar options, a model that holds one row at a time) waits until they finish; so do the requests behind
it (first in, first out). A prompt is prefilled whole when it is admitted, and at most
`prefill_tokens_per_step` prompt tokens are admitted at one boundary (at least one request), which bounds
how long the running rows wait for prefills.

Compiled steps (`compile`, a static cache) run in the engine too, on the compiled batch sizes (engine.py).
Generation options the speculative loop does not implement still run as batched calls (batched_call.py): the requests waiting
that agree in their settings decode together to the end.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from .admission import AdmissionPolicy, tokens_left
from .batch_request import BatchRequest
from .batched_call import batch_key, decode_batch
from .config import QuasarGenerationConfig
from .engine import DecodeEngine
from .own_thread import in_own_thread
from .prompt_cache import PromptCache
from .request_config import request_quasar_config
from .stats import QuasarStats, decayed_average

logger = logging.getLogger(__name__)

MAX_BATCH_SIZE = 8  # rows decoding at once (compiled steps round up to a power of two)
GATHER_SECONDS = 0.01  # how long a batched call waits for requests sent together with the first one
PREFILL_TOKENS_PER_STEP = 2048  # prompt tokens admitted at one step boundary (the running rows wait for them)
STEP_TIME_DECAY = 0.9  # weight the recent step time keeps at each new step


SHUTTING_DOWN = "the server is shutting down"


class RequestBatcher:
    """The worker thread that schedules and decodes requests for one model (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch_size: int = MAX_BATCH_SIZE,
        gather_seconds: float = GATHER_SECONDS,
        quasar: dict | None = None,
        on_call: Callable[[QuasarStats, int], None] | None = None,
        prompt_cache: PromptCache | None = None,
        prefill_tokens_per_step: int = PREFILL_TOKENS_PER_STEP,
        admission: AdmissionPolicy | None = None,
    ) -> None:
        """`quasar`: Quasar options the server sets for every request, under each request's own; `on_call`:
        receives the speculative counters of each prefill (rows 0) and each step or batched call (its rows);
        `prompt_cache`: keys and values of finished requests that a new one continues from; `gather_seconds`:
        how long batched calls (options the engine does not implement) wait for requests sent together with the first;
        `admission`: the order requests start in and which prefills run beside the running rows."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.max_batch_size = max_batch_size
        self.gather_seconds = gather_seconds
        self.quasar = quasar
        self.on_call = on_call
        self.prompt_cache = prompt_cache
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self.admission = admission or AdmissionPolicy()
        self.fatal_error: BaseException | None = None
        self.batches_run = 0  # batched calls and steps of the running batch
        self.rows_run = 0  # requests that started decoding
        self.widest_step = 0  # the most rows one step (or batched call) decoded together
        self._waiting: queue.Queue[BatchRequest | None] = queue.Queue()
        self._held: list[BatchRequest] = []
        self._stopping = threading.Event()
        self._engine: DecodeEngine | None = None
        self._in_call: list[BatchRequest] = []  # the requests of a batched call running now
        self._prefilling: tuple[BatchRequest, QuasarGenerationConfig, Future] | None = None  # a long prompt's prefill
        self._step_s: float | None = None  # recent seconds per step of the running rows (the admission policy's clock)
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
        """End the rows decoding now (each with its tokens so far, at the next step boundary), fail the requests
        still waiting, end the worker."""
        self._stopping.set()
        for request in list(self._in_call):
            request.cancel("shutdown")
        self._waiting.put(None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ worker thread
    def _work(self) -> None:
        self._engine = DecodeEngine(self.model, self.prompt_cache, self.on_call)
        try:
            while not self._stopping.is_set():
                self._take_arrivals(block=self._engine.rows == 0 and not self._held and self._prefilling is None)
                if self._stopping.is_set():
                    break
                self._join_prefilled(wait=self._engine.rows == 0)
                self._admit()
                if self._engine.rows and not self._stopping.is_set():
                    self._step()
        finally:
            if self._prefilling is not None:
                self._prefilling[0].cancel("shutdown")
                self._prefilling[0].finish(None)
            for request in self._engine.requests:
                request.cancel("shutdown")
                request.finish(None)
            for request in [*self._held, *(r for r in self._drain() if r is not None)]:
                request.finish_reason = "shutdown"
                request.finish(SHUTTING_DOWN)
            self._held = []
            self._engine.close()

    def _take_arrivals(self, block: bool) -> None:
        """Move submitted requests to the held list (waiting for the first one when nothing else is to do)."""
        if block:
            first = self._waiting.get()
            if first is None:
                self._stopping.set()
                return
            self._held.append(first)
        self._held.extend(r for r in self._drain() if r is not None)

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

    def _admit(self) -> None:
        """Admit held requests in the policy's order while rows are free, the prefill budget lasts and the running
        rows can take them; run the ones the engine cannot serve as batched calls once no row is running."""
        admitted_tokens = 0
        while self._held and self._engine.rows < self.max_batch_size and not self._stopping.is_set():
            if self._prefilling is not None:
                return  # the requests behind a long prompt wait for its prefill
            self._held = self.admission.order([r for r in self._held if not _finish_if_cancelled(r)], step_s=self._step_s)
            if not self._held:
                return
            request = self._held[0]
            try:
                config = request_quasar_config(self.model, request.runnable_config(), self.quasar, request.tokenizer)
            except Exception as failure:  # a bad `quasar` value: this request's fault only
                self._held.pop(0)
                request.finish(f"{type(failure).__name__}: {failure}")
                continue
            if config is None:
                if self._engine.rows:
                    return  # batched calls run once the rows decoding now finish
                self._run(self._batch_with(request))
                continue
            if not self._engine.can_join(config, request):
                return
            if admitted_tokens and admitted_tokens + len(request.input_ids) > self.prefill_tokens_per_step:
                return
            if self.admission.hold(request, [tokens_left(r) for r in self._engine.requests], step_s=self._step_s):
                return  # the running rows finish soon: it starts after them
            self._held.pop(0)
            admitted_tokens += len(request.input_ids)
            self._start(request, config)
            self._take_arrivals(block=False)

    def _start(self, request: BatchRequest, config: QuasarGenerationConfig) -> None:
        """Prefill the request and join it; one the policy prefills beside the running rows is prefilled in the
        prefill thread while they keep stepping (it joins at a later step boundary)."""
        self.rows_run += 1
        if request.on_start is not None:
            request.on_start()
        with self._failing_alone(request):
            prefix = self._engine.cached_prefix(request)
            if self.admission.prefill_beside_rows(request, [tokens_left(r) for r in self._engine.requests]):
                future = in_own_thread(self._engine.prefill, request, config, prefix)
                self._prefilling = (request, config, future)
                return
            self._engine.join(request, config, self._engine.prefill(request, config, prefix))

    def _join_prefilled(self, wait: bool) -> None:
        """Join the long prompt prefilled in the prefill thread once it is done (or wait for it: nothing else runs)."""
        if self._prefilling is None or not (wait or self._prefilling[2].done()):
            return
        request, config, future = self._prefilling
        self._prefilling = None
        with self._failing_alone(request):
            self._engine.join(request, config, future.result())

    @contextlib.contextmanager
    def _failing_alone(self, request: BatchRequest) -> Iterator[None]:
        """A request's own fault (a bad setting, a bad token) fails it alone; anything worse stops the worker."""
        try:
            yield
        except Exception as failure:
            logger.exception("quasar_hf: a request failed to start")
            request.finish(f"{type(failure).__name__}: {failure}")
        except BaseException as failure:  # noqa: B036 - the worker is gone: say so to every caller
            self._die(failure, [request])
            raise

    def _step(self) -> None:
        self.batches_run += 1
        self.widest_step = max(self.widest_step, self._engine.rows)
        started = time.perf_counter()
        try:
            self._engine.step()
            self._step_s = decayed_average(self._step_s, time.perf_counter() - started, STEP_TIME_DECAY)
        except Exception as failure:
            logger.exception("quasar_hf: a step of %d row(s) failed", self._engine.rows)
            self._engine.fail_all(f"{type(failure).__name__}: {failure}")
        except BaseException as failure:  # noqa: B036
            self._die(failure, self._engine.requests)
            raise

    def _die(self, failure: BaseException, requests: list[BatchRequest]) -> None:
        self.fatal_error = failure
        for request in requests:
            request.finish(f"the decoding worker died: {failure!r}")

    def _batch_with(self, first: BatchRequest) -> list[BatchRequest]:
        """`first` and the held requests that decode in one batched call with it."""
        if len(self._held) < self.max_batch_size:
            time.sleep(self.gather_seconds)
            self._take_arrivals(block=False)
        key = batch_key(first)
        batch = [r for r in self._held if batch_key(r) == key][: self.max_batch_size]
        self._held = [r for r in self._held if r not in batch]
        return batch

    def _run(self, batch: list[BatchRequest]) -> None:
        """One batched call to the end (options the engine does not implement)."""
        self.batches_run += 1
        self.rows_run += len(batch)
        self.widest_step = max(self.widest_step, len(batch))
        for request in batch:
            if request.on_start is not None:
                request.on_start()
        self._in_call = batch
        try:
            stats = decode_batch(self.model, batch, self.quasar, self.prompt_cache)
            error = None
        except Exception as failure:  # a request's own fault (bad settings, a bad row) fails its batch, not the server
            logger.exception("quasar_hf: a batch of %d request(s) failed", len(batch))
            stats, error = None, f"{type(failure).__name__}: {failure}"
        except BaseException as failure:  # noqa: B036
            self._die(failure, batch)
            raise
        finally:
            self._in_call = []
        if error is not None and len(batch) > 1 and not any(r.emitted for r in batch):
            for request in batch:  # nothing was sent yet: each request alone, so only the faulty one fails
                self._run([request])
            return
        if stats is not None and self.on_call is not None:
            self.on_call(stats, len(batch))
        for request in batch:
            request.finish(error)


def _finish_if_cancelled(request: BatchRequest) -> bool:
    if request.past_deadline():
        request.finish(None)
        return True
    return False
