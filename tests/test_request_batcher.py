"""RequestBatcher: requests sent together decode in one running batch, each row its own request's tokens, budget
and cancellation; plain (Quasar off) and options the loop declines run too. Rows joining and leaving a
running batch: tests/test_decode_engine.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import GenerationConfig

from quasar_hf.speculative.batched_call import batch_key
from quasar_hf.speculative.batcher import SHUTTING_DOWN, BatchRequest, RequestBatcher
from quasar_hf.speculative.left_padding import left_padded
from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [40, 41, 42, 40, 41], [70, 71, 72, 73, 74, 75, 70, 71, 72, 73]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return quantize_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("base")))


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.error = "not finished"
        self.done = threading.Event()

    def request(self, ids, **config) -> BatchRequest:
        options = {"max_new_tokens": 12, "do_sample": False, "eos_token_id": None, **config}
        return BatchRequest(list(ids), GenerationConfig(**options), self.tokens.extend, self.finish)

    def finish(self, error) -> None:
        self.error = error
        self.done.set()


def alone(model, ids, max_new_tokens=12, **options) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, **options)
    return out[0, len(ids) :].tolist()


def run_together(batcher, requests_and_collectors):
    for request, _ in requests_and_collectors:
        batcher.submit(request)
    for _, collector in requests_and_collectors:
        assert collector.done.wait(120)


def test_requests_sent_together_run_as_one_batch_with_each_rows_own_budget(model):
    batcher = RequestBatcher(model, gather_seconds=0.2)
    try:
        collectors = [Collector() for _ in PROMPTS]
        budgets = [12, 5, 9]
        run_together(batcher, [(c.request(p, max_new_tokens=b), c) for c, p, b in zip(collectors, PROMPTS, budgets)])
        assert batcher.widest_step == 3 and batcher.rows_run == 3
        for collector, prompt, budget in zip(collectors, PROMPTS, budgets):
            assert collector.error is None
            assert collector.tokens == alone(model, prompt, budget, quasar=False)
    finally:
        batcher.stop()


def test_sampled_requests_share_steps_and_each_draws_from_its_own_generator(model):
    batcher = RequestBatcher(model, gather_seconds=0.2)
    try:
        outputs = []
        for seed in (7, 7, 9):  # seeds whose 16 tokens hold no end-of-sequence token
            collectors = [Collector(), Collector()]
            requests = []
            for collector in collectors:
                request = collector.request(PROMPTS[1], do_sample=True, temperature=1.5, max_new_tokens=16)
                request.generator = torch.Generator().manual_seed(seed)
                requests.append((request, collector))
            run_together(batcher, requests)
            assert all(c.error is None and len(c.tokens) == 16 for c in collectors)
            outputs.append([c.tokens for c in collectors])
        assert outputs[0] == outputs[1] != outputs[2]  # a request's seed decides its tokens, whatever runs beside it
        assert outputs[0][0] == outputs[0][1]  # two requests with one seed, sent together: the same tokens
        assert batcher.widest_step == 2
    finally:
        batcher.stop()


def test_quasar_off_and_declined_options_run_plain_decoding(model):
    batcher = RequestBatcher(model, gather_seconds=0.05)
    try:
        off, declined = Collector(), Collector()
        run_together(batcher, [(off.request(PROMPTS[0], quasar=False), off)])
        run_together(batcher, [(declined.request(PROMPTS[1], output_scores=True), declined)])
        assert off.error is None and off.tokens == alone(model, PROMPTS[0], quasar=False)
        assert declined.error is None and declined.tokens == alone(model, PROMPTS[1], quasar=False)
    finally:
        batcher.stop()


def test_requests_with_use_cache_off_still_join_the_running_batch(model):
    """Transformers' continuous batching sends use_cache=False (it keeps a paged cache of its own); every path here
    keeps a cache (BatchRequest.runnable_config), so such requests join the running batch step by step, as the
    batched call they would otherwise wait for would decode them with the loop anyway."""
    batcher = RequestBatcher(model, gather_seconds=0.2)
    try:
        collectors = [Collector(), Collector()]
        run_together(batcher, [(c.request(p, use_cache=False), c) for c, p in zip(collectors, PROMPTS)])
        assert batcher.widest_step == 2 and batcher.batches_run > 1  # steps of the running batch, not one call
        for collector, prompt in zip(collectors, PROMPTS):
            assert collector.error is None and collector.tokens == alone(model, prompt, quasar=False)
    finally:
        batcher.stop()


def test_a_cancelled_row_stops_and_the_others_finish(model):
    batcher = RequestBatcher(model, gather_seconds=0.2)
    try:
        first, second = Collector(), Collector()
        cancelled = first.request(PROMPTS[0], max_new_tokens=40)
        original = cancelled.on_tokens

        def cancel_after_first_tokens(tokens):
            original(tokens)
            cancelled.cancel()

        cancelled.on_tokens = cancel_after_first_tokens
        run_together(batcher, [(cancelled, first), (second.request(PROMPTS[2], max_new_tokens=20), second)])
        assert first.error is None and 0 < len(first.tokens) < 40
        assert second.tokens == alone(model, PROMPTS[2], 20, quasar=False)
    finally:
        batcher.stop()


def test_a_failing_request_fails_alone_and_the_batcher_keeps_serving(model):
    batcher = RequestBatcher(model, gather_seconds=0.05)
    try:
        bad, good = Collector(), Collector()
        run_together(batcher, [(bad.request([5, 6, 7], quasar={"num_draft_tokens": -1}), bad)])
        assert bad.error is not None and "num_draft_tokens" in bad.error
        run_together(batcher, [(good.request(PROMPTS[1]), good)])
        assert good.error is None and good.tokens == alone(model, PROMPTS[1], quasar=False)
    finally:
        batcher.stop()


def test_a_bad_row_fails_only_its_own_request_and_the_others_equal_alone(model):
    """A token id past the vocabulary fails that request's prefill; the others decode."""
    batcher = RequestBatcher(model, gather_seconds=0.2)
    try:
        collectors = [Collector() for _ in range(3)]
        prompts = [PROMPTS[0], [5, 6, model.config.vocab_size + 50], PROMPTS[2]]
        run_together(batcher, [(c.request(p), c) for c, p in zip(collectors, prompts)])
        assert collectors[1].error is not None and collectors[1].tokens == []
        for index in (0, 2):
            assert collectors[index].error is None
            assert collectors[index].tokens == alone(model, prompts[index], quasar=False)
    finally:
        batcher.stop()


def test_a_short_request_completes_while_a_long_one_in_its_batch_still_decodes(model):
    batcher = RequestBatcher(model, gather_seconds=0.2)
    try:
        short, long = Collector(), Collector()
        tokens_of_long_when_short_ended: list[int] = []
        original_finish = short.finish

        def short_done(error) -> None:
            tokens_of_long_when_short_ended.append(len(long.tokens))
            original_finish(error)

        short_request = short.request(PROMPTS[1], max_new_tokens=20)  # the long one asks under 4x: it joins the short
        short_request.on_done = short_done
        run_together(batcher, [(short_request, short), (long.request(PROMPTS[0], max_new_tokens=60), long)])
        assert batcher.widest_step == 2 and short.tokens == alone(model, PROMPTS[1], 20, quasar=False)
        assert tokens_of_long_when_short_ended[0] < 60 and long.tokens == alone(model, PROMPTS[0], 60, quasar=False)
    finally:
        batcher.stop()


def test_a_row_past_its_deadline_ends_with_its_tokens_so_far(model):
    batcher = RequestBatcher(model, gather_seconds=0.01)
    try:
        collector = Collector()
        request = collector.request(PROMPTS[0], max_new_tokens=1500)
        request.deadline = time.monotonic() + 0.3
        run_together(batcher, [(request, collector)])
        assert collector.error is None and request.finish_reason == "timeout"
        assert 0 < len(collector.tokens) < 1500
        expired = Collector()
        late = expired.request(PROMPTS[1])
        late.deadline = time.monotonic() - 1  # already past when the worker takes it
        run_together(batcher, [(late, expired)])
        assert expired.error is None and expired.tokens == [] and late.finish_reason == "timeout"
    finally:
        batcher.stop()


def test_stop_ends_the_running_rows_and_fails_the_waiting_requests(model):
    batcher = RequestBatcher(model, max_batch_size=1, gather_seconds=0.01)
    running, waiting = Collector(), Collector()
    started = threading.Event()
    first = running.request(PROMPTS[0], max_new_tokens=1500)
    first.on_tokens = lambda tokens: (running.tokens.extend(tokens), started.set())
    batcher.submit(first)
    batcher.submit(waiting.request(PROMPTS[1], max_new_tokens=1500))
    assert started.wait(60)
    began = time.monotonic()
    batcher.stop(timeout=30)
    assert time.monotonic() - began < 10 and not batcher.is_alive
    assert running.error is None and first.finish_reason == "shutdown" and 0 < len(running.tokens) < 1500
    assert waiting.error == SHUTTING_DOWN and waiting.tokens == []


def test_sampled_requests_never_share_a_batched_call():
    """Batched calls (options the engine does not implement) run their rows to the end with one generator: a sampled
    request runs alone."""
    greedy = BatchRequest([1], GenerationConfig(max_new_tokens=4), print, print)
    other = BatchRequest([2, 3], GenerationConfig(max_new_tokens=9), print, print)
    sampled = BatchRequest([1], GenerationConfig(max_new_tokens=4, do_sample=True), print, print)
    alone = BatchRequest([1], GenerationConfig(max_new_tokens=4, do_sample=True), print, print)
    assert batch_key(greedy) == batch_key(other) != batch_key(sampled) == batch_key(sampled) != batch_key(alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_left_padded_long_prefill_gives_each_row_the_bits_it_gets_alone(tmp_path, dtype):
    """Prompts past the kernel's prefill limit (64 tokens) go to SDPA: in a left-padded batch each row runs
    SDPA on its own tokens, the call it makes alone, so served batches decode what single requests do."""
    model = quantize_tiny(make_tiny_checkpoint(tmp_path / "base"), dtype=dtype)
    prompts = [torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(n)) for n in (70, 99, 130)]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # what generate gives a left-padded row
        batched = model(ids, attention_mask=mask, position_ids=positions).logits[:, -1]
        for row, prompt in enumerate(prompts):
            assert torch.equal(batched[row], model(prompt[None]).logits[0, -1]), f"row {row}"
