"""Continuing from an earlier turn's KV cache: `generate(quasar=True, past_key_values=...)` gives plain generate's
tokens, and the server's PromptCache reuses the longest cached token prefix (only the shared part), within its
byte budget, least recently used first out."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from quasar_hf import compat
from quasar_hf.speculative.batcher import BatchRequest, RequestBatcher
from quasar_hf.speculative.prompt_cache import PromptCache
from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny

TURN_1 = [5, 6, 7, 8, 5, 6, 7, 8, 9, 10, 5, 6, 7]
TURN_2_TAIL = [40, 41, 42, 5, 6, 7, 8]


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def model(request, tmp_path_factory):
    return quantize_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("base")), dtype=request.param)


def greedy(model, ids: torch.Tensor, cache: DynamicCache | None, quasar, new: int = 20):
    options = {} if cache is None else {compat.cache_argument_name(model): copy.deepcopy(cache)}
    return model.generate(
        ids, max_new_tokens=new, do_sample=False, eos_token_id=None, quasar=quasar, return_dict_in_generate=True, **options
    )


def test_quasar_continues_from_an_earlier_turns_cache_as_plain_generate_does(model):
    first = greedy(model, torch.tensor([TURN_1]), None, False, 12)
    ours = greedy(model, torch.tensor([TURN_1]), None, True, 12)
    assert torch.equal(ours.sequences, first.sequences)
    for (k, v), (k_ours, v_ours) in zip(
        compat.cache_key_values(first.past_key_values), compat.cache_key_values(ours.past_key_values)
    ):
        assert torch.equal(k, k_ours) and torch.equal(v, v_ours)  # the returned cache holds the same bits
    turn_2 = torch.cat([first.sequences, torch.tensor([TURN_2_TAIL])], dim=1)
    plain = greedy(model, turn_2, first.past_key_values, False)
    assert torch.equal(greedy(model, turn_2, first.past_key_values, True).sequences, plain.sequences)
    assert torch.equal(greedy(model, turn_2, ours.past_key_values, True).sequences, plain.sequences)


def test_a_cache_the_loop_cannot_continue_from_is_refused(model):
    first = greedy(model, torch.tensor([TURN_1]), None, False, 4)
    with pytest.raises(ValueError, match="longer than the cache"):
        greedy(model, first.sequences[:, :5], first.past_key_values, True)
    with pytest.raises(ValueError, match="one unpadded prompt"):
        greedy(model, first.sequences.repeat(2, 1), first.past_key_values, True)


def layers(tokens: int, value: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kv = torch.full((1, 2, tokens, 4), value)
    return [(kv, kv.clone()) for _ in range(2)]


def test_the_longest_shared_prefix_is_reused_and_only_the_shared_part():
    cache = PromptCache(max_bytes=10**6)
    system = list(range(100, 130))
    cache.store(system + [1, 2, 3, 4], layers(34, 1.0))
    assert cache.longest_prefix(system + [9, 9, 9]).tokens == 30  # a shared system prompt, another question
    hit = cache.longest_prefix(system + [1, 2, 3, 4, 5])
    assert hit.tokens == 34 and hit.layers[0][0].shape[-2] == 34 and float(hit.layers[0][0][0, 0, 0, 0]) == 1.0
    assert cache.longest_prefix(system + [1, 2, 3, 4]).tokens == 33  # the last prompt token is always prefilled
    assert cache.longest_prefix([7] + system) is None
    assert cache.longest_prefix(system[:3] + [0], min_tokens=4) is None


def test_entries_leave_least_recently_used_first_within_the_byte_budget():
    one = sum(k.numel() * k.element_size() * 2 for k, _ in layers(10))
    cache = PromptCache(max_bytes=int(2.5 * one))
    cache.store(list(range(10)), layers(10))
    cache.store(list(range(20, 30)), layers(10))
    assert cache.longest_prefix(list(range(11))) is not None  # touch the first: the second is now the oldest
    cache.store(list(range(40, 50)), layers(10))
    assert cache.longest_prefix(list(range(20, 31))) is None and cache.longest_prefix(list(range(11))) is not None
    assert cache.bytes <= 2.5 * one
    cache.store(list(range(12)), layers(12))  # extends the first entry: replaces it
    assert len(cache) == 2 and cache.longest_prefix(list(range(13))).tokens == 12
    PromptCache(max_bytes=one // 2).store(list(range(10)), layers(10))  # larger than the budget: not kept


def served_together(batcher: RequestBatcher, asks: list[tuple[list[int], int]]) -> list[tuple[list[int], BatchRequest]]:
    """Submit greedy requests (prompt, new tokens) at once; each one's tokens and request once all are done."""
    results = []
    for ids, new in asks:
        tokens, done = [], threading.Event()
        config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None)
        request = BatchRequest(list(ids), config, tokens.extend, lambda error, done=done: done.set())
        request.done_event = done
        results.append((tokens, request))
        batcher.submit(request)
    for _, request in results:
        assert request.done_event.wait(120)
    return results


def plain_continuation(model, turn_1: list[int], new_1: int, turn_2: list[int]) -> list[int]:
    """Plain greedy decoding of turn 2 continuing from turn 1's cache (each alone)."""
    reference = greedy(model, torch.tensor([turn_1]), None, False, new_1)
    return greedy(model, torch.tensor([turn_2]), reference.past_key_values, False).sequences[0, len(turn_2) :].tolist()


def test_a_served_turn_reuses_the_last_turn_and_gives_plain_generates_tokens(model):
    batcher = RequestBatcher(model, gather_seconds=0.01, prompt_cache=PromptCache(max_bytes=10**8))
    try:
        [(first_tokens, first)] = served_together(batcher, [(TURN_1, 12)])
        assert first.reused_tokens == 0
        turn_2 = TURN_1 + first_tokens + TURN_2_TAIL
        [(second_tokens, second)] = served_together(batcher, [(turn_2, 20)])
        assert second.reused_tokens == len(TURN_1) + len(first_tokens) - 1  # all but the last token's KV was kept
        assert second_tokens == plain_continuation(model, TURN_1, 12, turn_2)
    finally:
        batcher.stop()


def test_rows_of_a_batch_continue_from_their_own_cached_prefixes_and_leave_theirs(model):
    batcher = RequestBatcher(model, gather_seconds=0.3, prompt_cache=PromptCache(max_bytes=10**8))
    conversations = [TURN_1, [70, 71, 72, 73, 74, 75] * 3]
    try:
        firsts = served_together(batcher, [(ids, 12) for ids in conversations])
        assert batcher.widest_step == 2 and all(request.reused_tokens == 0 for _, request in firsts)
        turns_2 = [ids + tokens + TURN_2_TAIL for ids, (tokens, _) in zip(conversations, firsts)]
        seconds = served_together(batcher, [(ids, 20) for ids in turns_2])
        for ids, (tokens, _), turn_2, (second_tokens, second) in zip(conversations, firsts, turns_2, seconds):
            assert second.reused_tokens == len(ids) + len(tokens) - 1
            assert second_tokens == plain_continuation(model, ids, 12, turn_2)
    finally:
        batcher.stop()
