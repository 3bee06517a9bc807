"""MaskFacts: what a long prefill's attention branches read from the mask is read once per forward, not once per
layer, and the forward computes the same bits either way (a left-padded batch's prompt, a turn over a cache, a
prompt into an empty static cache)."""

import copy

import pytest
import torch

from quasar_hf import compat
from quasar_hf.ops import rowstable_attention
from quasar_hf.ops.rowstable_attention import MASK_FACTS_KWARG, MaskFacts
from quasar_hf.speculative import verify_attention
from tests.test_prefill_continuation import needs_kernel, qwen3_w8a8  # noqa: F401  (fixture)


def test_a_fact_is_found_once_per_mask_and_shape():
    facts, found = MaskFacts(), []
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    for _ in range(3):
        assert facts.get(mask, "pads", (4,), lambda: found.append(1) or [0, 1]) == [0, 1]
    assert len(found) == 1 and facts.reads == 1
    facts.get(mask, "pads", (3,), lambda: found.append(1))  # another call shape
    facts.get(mask, "other", (4,), lambda: found.append(1))  # another fact
    facts.get(mask.clone(), "pads", (4,), lambda: found.append(1))  # another mask (same shape and values)
    facts.get(None, "pads", (4,), lambda: found.append(1))
    facts.get(None, "pads", (4,), lambda: found.append(1))
    assert len(found) == 5 and facts.reads == 5


def test_a_mask_at_a_freed_masks_address_is_read_again():
    facts = MaskFacts()
    first = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    facts.get(first, "any", (8,), lambda: False)
    address = first.data_ptr()
    del first
    second = torch.ones(1, 1, 8, 8, dtype=torch.bool)  # the allocator may hand out the freed block again
    assert facts.get(second, "any", (8,), lambda: bool(second.any())) is True
    assert facts.reads == 2 or second.data_ptr() != address


def counted(monkeypatch, name: str) -> list[int]:
    """Calls of rowstable_attention.`name` (a helper whose every call reads the mask) from now on."""
    calls, real = [], getattr(rowstable_attention, name)
    monkeypatch.setattr(rowstable_attention, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@needs_kernel
def test_a_turn_over_a_cache_reads_its_mask_once_and_keeps_its_bits(qwen3_w8a8, monkeypatch):  # noqa: F811
    model, layers = qwen3_w8a8, qwen3_w8a8.config.num_hidden_layers
    gen = torch.Generator().manual_seed(5)
    first, turn = torch.randint(0, 96, (1, 90), generator=gen), torch.randint(0, 96, (1, 80), generator=gen)
    with torch.inference_mode():
        cache = model(first, use_cache=True).past_key_values
        checks = counted(monkeypatch, "_bottom_right_causal")

        def turn_logits(**kwargs):
            mask = torch.ones(1, 170, dtype=torch.long)
            past = {compat.cache_argument_name(model): copy.deepcopy(cache)}
            # a mask of ones over cache and turn: Transformers builds the 4D bottom-right causal mask
            return model(turn, attention_mask=mask, position_ids=torch.arange(90, 170)[None], **past, **kwargs).logits

        alone = turn_logits()
        assert len(checks) == layers  # without facts: every layer reads the mask
        facts = MaskFacts()
        shared = turn_logits(**{MASK_FACTS_KWARG: facts})
    # two facts (the keys past the turn are seen: no empty static cache; bottom-right causal), each read once
    assert len(checks) == layers + 1 and facts.reads == 2
    assert torch.equal(shared, alone)


def test_a_left_padded_prompt_reads_its_padding_once_and_keeps_its_bits(qwen3_w8a8, monkeypatch):  # noqa: F811
    model = qwen3_w8a8
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 96, (2, 100), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :25] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        alone = model(ids, attention_mask=mask, position_ids=positions).logits
        facts = MaskFacts()
        shared = model(ids, attention_mask=mask, position_ids=positions, **{MASK_FACTS_KWARG: facts}).logits
    assert facts.reads == 1 and torch.equal(shared, alone)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_hands_its_long_prefills_one_mask_facts_per_forward(qwen3_w8a8, monkeypatch, cache):  # noqa: F811
    """The speculative loop's prefill forwards (a left-padded batch: dynamic; a prompt into an empty static cache:
    static) carry MaskFacts, each read at most once per fact, and the tokens stay plain decoding's."""
    made = []

    class Recorded(MaskFacts):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(verify_attention, "MaskFacts", Recorded)
    model = qwen3_w8a8
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 96, (2, 90), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    quasar = {"cache_implementation": cache}
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, quasar={**quasar, "num_draft_tokens": 0})
    spec = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, quasar=quasar)
    assert torch.equal(spec, plain)
    assert made and all(facts.reads <= 2 for facts in made)  # a padded prompt in a static cache: two facts
    assert sum(facts.reads for facts in made) > 0
