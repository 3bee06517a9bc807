"""The admission policy (speculative/admission.py) and the scheduler following it: the shortest request held at a
step boundary starts first, a long-held one before any, and each still decodes what it decodes alone."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from transformers import GenerationConfig

from quasar_hf.speculative.admission import AdmissionPolicy
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


def test_a_request_is_prefilled_beside_running_rows_when_its_prompt_or_its_ask_is_long():
    policy = AdmissionPolicy(background_prefill_tokens=256, long_ratio=4)
    assert not policy.prefill_beside_rows(held(4096, 0, prompt=1000), [])  # no running row to stall
    assert policy.prefill_beside_rows(held(8, 0, prompt=300), [500])  # a long prompt
    cached = held(8, 0, prompt=300)
    cached.reused_tokens = 100  # 200 tokens left to prefill
    assert not policy.prefill_beside_rows(cached, [500])
    assert policy.prefill_beside_rows(held(256, 0), [16, 40])  # asks over 4x what any running row has left
    assert not policy.prefill_beside_rows(held(160, 0), [16, 40])
    assert policy.prefill_beside_rows(held(None, 0), [16])  # no budget: as long as the context
    for bad in ({"fair_wait_s": -1}, {"background_prefill_tokens": -1}, {"long_ratio": 0.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AdmissionPolicy(**bad)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return quantize_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("base"), initializer_range=0.3))


def test_short_requests_held_with_long_ones_start_first_and_give_their_tokens_alone(model, monkeypatch):
    """Four requests arrive while a step runs (held there), the long ones first; the short ones start first."""
    order = itertools.count()
    first_token: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}
    finished: dict[str, threading.Event] = {}

    def request(name: str, ids: list[int], budget: int) -> BatchRequest:
        outputs[name], finished[name] = [], threading.Event()

        def on_tokens(tokens: list[int]) -> None:
            first_token.setdefault(name, next(order))
            outputs[name].extend(tokens)

        return BatchRequest(
            ids, GenerationConfig(max_new_tokens=budget, do_sample=False), on_tokens, lambda e: finished[name].set()
        )

    step, in_step, release = DecodeEngine.step, threading.Event(), threading.Event()

    def held_step(self) -> None:
        in_step.set()
        release.wait(30)
        step(self)

    monkeypatch.setattr(DecodeEngine, "step", held_step)
    prompts = {
        "running": [5, 6, 7, 8] * 3,
        "long1": [20, 21, 22] * 4,
        "long2": [30, 31] * 5,
        "short1": [40, 41, 42],
        "short2": [50, 51] * 3,
    }
    budgets = {"running": 30, "long1": 40, "long2": 36, "short1": 4, "short2": 5}
    batcher = RequestBatcher(model)
    try:
        batcher.submit(request("running", prompts["running"], budgets["running"]))
        assert in_step.wait(30)
        for name in ("long1", "long2", "short1", "short2"):  # held until the step ends
            batcher.submit(request(name, prompts[name], budgets[name]))
        release.set()
        assert all(event.wait(60) for event in finished.values())
    finally:
        batcher.stop()
    assert max(first_token["short1"], first_token["short2"]) < min(first_token["long1"], first_token["long2"])
    for name, ids in prompts.items():
        plain = model.generate(torch.tensor([ids]), max_new_tokens=budgets[name], do_sample=False, quasar=False)
        assert outputs[name] == plain[0, len(ids) :].tolist(), name
