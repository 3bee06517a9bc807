"""The admission policy (speculative/admission.py) and the scheduler following it: the shortest request held at a
step boundary starts first, a long-held one before any, and each still decodes what it decodes alone."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from transformers import GenerationConfig

from quasar_hf.speculative.admission import AdmissionPolicy, tokens_left
from quasar_hf.speculative.batcher import BatchRequest, RequestBatcher
from quasar_hf.speculative.engine import DecodeEngine
from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny


def held(asked: int | None, arrived: float, prompt: int = 8) -> BatchRequest:
    request = BatchRequest(list(range(3, 3 + prompt)), GenerationConfig(max_new_tokens=asked), lambda t: None, lambda e: None)
    request.arrived = arrived
    return request


def test_the_fewest_asked_tokens_go_first_and_a_request_held_long_goes_before_them():
    policy = AdmissionPolicy(fair_wait_s=1.0)
    long_old, short_new, short_old, unbounded, medium = (
        held(256, 9.5),
        held(16, 9.9),
        held(16, 9.6),
        held(None, 9.0),
        held(64, 9.7),
    )
    assert policy.order([long_old, short_new, unbounded, short_old, medium], now=9.95) == [
        short_old,
        short_new,
        medium,
        long_old,
        unbounded,
    ]
    # at 10.6 the request asking 256 tokens has been held 1.1 s and the unbounded one 1.6 s: oldest first, then the rest
    assert policy.order([long_old, short_new, unbounded, short_old, medium], now=10.6) == [
        unbounded,
        long_old,
        short_old,
        short_new,
        medium,
    ]


def test_where_steps_are_slow_a_long_request_is_held_as_long_as_the_rows_that_hold_it_can_take():
    """The fair wait is fair_wait_s, or asked / long_ratio steps at the recent step time when longer: the rows that
    hold a request each have fewer tokens than that left, so they end within it."""
    policy = AdmissionPolicy(fair_wait_s=1.0, long_ratio=4, hold_rows=2)
    long_ask, short_ask, unbounded = held(256, 0.0), held(16, 0.5), held(None, 0.0)
    assert policy.fair_wait(long_ask) == 1.0 and policy.fair_wait(long_ask, step_s=0.01) == 1.0  # 64 steps: 0.64 s
    assert policy.fair_wait(long_ask, step_s=0.035) == pytest.approx(64 * 0.035)  # slower steps: 2.24 s
    assert policy.fair_wait(unbounded, step_s=0.035) == 1.0  # no budget: no bound from its ask
    # held 1.5 s behind 2 short rows: a fixed second would let it go now; 35 ms steps keep it waiting
    assert not policy.hold(long_ask, [12, 10], now=1.5)
    assert policy.hold(long_ask, [12, 10], now=1.5, step_s=0.035)
    assert not policy.hold(long_ask, [12, 10], now=2.3, step_s=0.035)  # past 2.24 s it goes
    assert policy.order([long_ask, short_ask], now=1.5) == [long_ask, short_ask]
    assert policy.order([long_ask, short_ask], now=1.5, step_s=0.035) == [short_ask, long_ask]
    fixed = AdmissionPolicy(fair_wait_s=1.0, long_ratio=4, hold_rows=2, scale_fair_wait=False)
    assert fixed.fair_wait(long_ask, step_s=0.035) == 1.0 and not fixed.hold(long_ask, [12, 10], now=1.5, step_s=0.035)


def test_a_long_prompt_is_prefilled_beside_running_rows_and_a_long_ask_waits_for_short_rows():
    policy = AdmissionPolicy(background_prefill_tokens=256, long_ratio=4, hold_rows=3, fair_wait_s=1.0)
    assert not policy.prefill_beside_rows(held(4096, 0, prompt=1000), [])  # no running row to stall
    assert policy.prefill_beside_rows(held(8, 0, prompt=300), [500])  # a long prompt
    cached = held(8, 0, prompt=300)
    cached.reused_tokens = 100  # 200 tokens left to prefill
    assert not policy.prefill_beside_rows(cached, [500])
    assert policy.hold(held(256, 0.0), [16, 15, 40], now=0.5)  # over 4x what each of 3 rows has left
    assert not policy.hold(held(160, 0.0), [16, 15, 40], now=0.5)  # over 4x what only 2 of them have left
    assert policy.hold(held(256, 0.0), [16, 15, 12, 250], now=0.5)  # 3 short rows beside a long one: held
    assert not policy.hold(held(256, 0.0), [16, 15], now=0.5)  # too few rows to be worth holding for
    assert not policy.hold(held(256, 0.0), [16, 15, 40], now=1.0)  # held its fair wait: it goes now
    assert policy.hold(held(None, 0.0), [16, 15, 14], now=0.5)  # no budget: as long as the context
    assert not policy.hold(held(4096, 0.0), [16, 15, tokens_left(held(None, 0.0))], now=0.5)  # a row without one
    for bad in ({"fair_wait_s": -1}, {"background_prefill_tokens": -1}, {"long_ratio": 0.5}, {"hold_rows": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AdmissionPolicy(**bad)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return quantize_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("base"), initializer_range=0.3))


def held_together(model, monkeypatch, requests: dict[str, tuple[list[int], int]], admission: AdmissionPolicy):
    """Serve `requests` (name -> prompt, budget), the first alone, the others submitted while its first step is held
    (so they are all held at one step boundary); return each one's tokens and the order of its first and last."""
    order = itertools.count()
    first_token, last_token, outputs, finished = {}, {}, {}, {}

    def request(name: str, ids: list[int], budget: int) -> BatchRequest:
        outputs[name], finished[name] = [], threading.Event()

        def on_tokens(tokens: list[int]) -> None:
            first_token.setdefault(name, next(order))
            outputs[name].extend(tokens)

        def on_done(error) -> None:
            last_token[name] = next(order)
            finished[name].set()

        return BatchRequest(ids, GenerationConfig(max_new_tokens=budget, do_sample=False), on_tokens, on_done)

    step, in_step, release = DecodeEngine.step, threading.Event(), threading.Event()

    def held_step(self) -> None:
        in_step.set()
        release.wait(30)
        step(self)

    monkeypatch.setattr(DecodeEngine, "step", held_step)
    batcher = RequestBatcher(model, admission=admission)
    try:
        (name, (ids, budget)), *others = requests.items()
        batcher.submit(request(name, ids, budget))
        assert in_step.wait(30)
        for name, (ids, budget) in others:
            batcher.submit(request(name, ids, budget))
        release.set()
        assert all(event.wait(60) for event in finished.values())
    finally:
        batcher.stop()
    for name, (ids, budget) in requests.items():
        plain = model.generate(torch.tensor([ids]), max_new_tokens=budget, do_sample=False, quasar=False)
        assert outputs[name] == plain[0, len(ids) :].tolist(), name
    return first_token, last_token


def test_short_requests_held_with_long_ones_start_first_and_give_their_tokens_alone(model, monkeypatch):
    """Four requests arrive while a step runs (held there), the long ones first; the short ones start first."""
    requests = {
        "running": ([5, 6, 7, 8] * 3, 30),
        "long1": ([20, 21, 22] * 4, 40),
        "long2": ([30, 31] * 5, 36),
        "short1": ([40, 41, 42], 4),
        "short2": ([50, 51] * 3, 5),
    }
    first, _ = held_together(model, monkeypatch, requests, AdmissionPolicy())
    assert max(first["short1"], first["short2"]) < min(first["long1"], first["long2"])


def test_a_long_request_waits_for_three_short_rows_to_finish_and_not_past_its_fair_wait(model, monkeypatch):
    requests = {"running": ([5, 6, 7, 8] * 3, 6), "long": ([20, 21, 22] * 4, 40)}
    requests.update({f"short{i}": ([40 + i, 41, 42, 43] * 2, 6) for i in range(3)})
    first, last = held_together(model, monkeypatch, requests, AdmissionPolicy())
    assert first["long"] > max(last[name] for name in requests if name != "long")
    first, last = held_together(
        model, monkeypatch, requests, AdmissionPolicy(fair_wait_s=0.0, scale_fair_wait=False)
    )  # never held
    assert first["long"] < max(last[name] for name in requests if name != "long")


def test_a_long_request_waits_for_short_rows_beside_a_long_one_already_running(model, monkeypatch):
    """Over HTTP a long request may arrive first and start alone; the long ones behind it still wait for the short
    rows that joined it (the rows that hold a request are counted, not required to be every row)."""
    requests = {"running": ([5, 6, 7, 8] * 3, 40), "long": ([20, 21, 22] * 4, 40)}
    requests.update({f"short{i}": ([40 + i, 41, 42, 43] * 2, 6) for i in range(3)})
    first, last = held_together(model, monkeypatch, requests, AdmissionPolicy())
    assert first["long"] > max(last[f"short{i}"] for i in range(3))
