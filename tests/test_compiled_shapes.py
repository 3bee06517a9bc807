"""Compiled steps over any sequence of shapes (speculative/compiled_steps.py).

A long-lived process calling compiled `generate(quasar=...)` with changing batch sizes, lengths and
draft widths never meets Dynamo's recompile limit, and every output equals compiled plain greedy
decoding (`num_draft_tokens=0`) of the same prompts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo

import quasar_hf
from quasar_hf.speculative import compiled_steps
from quasar_hf.speculative.compiled_steps import (
    COMPILED_SLOTS_BASE,
    batch_bucket,
    call_cache_slots,
    compiled_cache_slots,
    compiled_steps_for,
)
from quasar_hf.speculative.config import DEFAULT_NUM_DRAFT_TOKENS
from quasar_hf.speculative.left_padding import left_padded
from tests.helpers.compiled_steps import AOT_EAGER
from tests.helpers.prompts import repeating_prompt
from tests.helpers.tiny_models import quasar_model

needs_kernels = pytest.mark.kernels("rowstable_linear", "attention")

COMPILED = {"compile": AOT_EAGER}  # Dynamo's graphs and guards (what the limit counts), eager kernels: seconds


def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` left-padded prompts of different lengths that repeat themselves (n-gram drafts get accepted)."""
    return left_padded([repeating_prompt(seed, 12 + 3 * seed) for seed in range(size)])


def compiled_greedy(model, ids, mask, new_tokens: int, **quasar) -> torch.Tensor:
    options = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return model.generate(ids, quasar={**COMPILED, **quasar}, **options)


def test_batches_round_to_powers_of_two_and_every_length_shares_one_cache_size():
    assert [batch_bucket(b) for b in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert [compiled_cache_slots(t) for t in (1, 257, 2000, 4096, 4097)] == [4096, 4096, 4096, 4096, 8192]
    assert [compiled_cache_slots(t, context=500) for t in (1, 512, 513)] == [512, 512, 1024]  # a short context
    with pytest.raises(ValueError, match="batch size"):
        batch_bucket(0)


def test_a_compiled_servers_longest_request_takes_the_cache_size_warm_up_compiled():
    """A request without max_tokens gets what the context leaves: with its padded verify step it must still fit the
    warm cache (else it compiles a new shape inside the request and cannot join the running rows)."""
    from quasar_hf.commands.serve import compiled_model_len

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=8192))
    warm = call_cache_slots(model, 1, DEFAULT_NUM_DRAFT_TOKENS)  # what warm_up(max_length=None) compiles
    assert call_cache_slots(model, compiled_model_len(), DEFAULT_NUM_DRAFT_TOKENS) == warm == COMPILED_SLOTS_BASE
    assert call_cache_slots(model, compiled_model_len() + 1, DEFAULT_NUM_DRAFT_TOKENS) == 2 * COMPILED_SLOTS_BASE


@needs_kernels
def test_any_sequence_of_batch_sizes_and_lengths_stays_compiled_and_exact(tmp_path):
    """Batch sizes 1 to 6, then a longer generation (a larger cache), then back: each compiled quasar
    output equals compiled plain greedy, and no call raises (main raised at the fifth batch size)."""
    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    torch._dynamo.reset()
    accepted_somewhere = False
    with torch.no_grad():
        for size, new_tokens in [(1, 8), (2, 8), (3, 8), (4, 8), (5, 8), (6, 8), (2, 300), (1, 8)]:
            ids, mask = batch(size)
            plain = compiled_greedy(model, ids, mask, new_tokens, num_draft_tokens=0)
            options = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            out = model.generate(ids, quasar=COMPILED, eos_token_id=None, return_dict_in_generate=True, **options)
            assert torch.equal(out.sequences, plain), f"batch {size}, {new_tokens} tokens"
            accepted_somewhere |= out.quasar_stats.accepted_tokens > 0
    table = compiled_steps_for(model, AOT_EAGER)
    assert set(table.steps) == {(1, 512), (2, 512), (4, 512), (8, 512)}  # 300 new tokens: the same cache size
    assert table.compiled_keys == 4 and accepted_somewhere
    torch._dynamo.reset()


@needs_kernels
def test_the_oldest_shape_is_dropped_and_compiles_again_with_the_same_tokens(tmp_path):
    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    torch._dynamo.reset()
    table = compiled_steps.CompiledSteps(model, AOT_EAGER, max_shapes=2)
    model.__dict__[compiled_steps.TABLE_ATTR] = table
    with torch.no_grad():
        first = compiled_greedy(model, *batch(1), 8)
        for size in (2, 3):
            compiled_greedy(model, *batch(size), 8)
        # A set: the batch-3 call may move its rows to batch 2's steps as they finish (a shrink, which the step gate's
        # timings decide), making those the most recently used.
        assert set(table.steps) == {(2, 512), (4, 512)}, "batch 1's steps were dropped"
        again = compiled_greedy(model, *batch(1), 8)
    assert torch.equal(again, first) and table.compiled_keys == 4
    torch._dynamo.reset()


@needs_kernels
def test_more_draft_widths_than_dynamo_allows_one_function_still_run(tmp_path):
    """num_draft_tokens 1..8 at one shape: a decode graph and eight verify graphs, one more than
    Dynamo's recompile_limit (8) lets one function hold; the step is rebuilt, and stays exact."""
    assert torch._dynamo.config.recompile_limit == 8
    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    ids, mask = batch(1)
    torch._dynamo.reset()
    with torch.no_grad():
        plain = compiled_greedy(model, ids, mask, 10, num_draft_tokens=0)
        for width in range(1, 9):
            assert torch.equal(compiled_greedy(model, ids, mask, 10, num_draft_tokens=width), plain), f"width {width}"
    table = compiled_steps_for(model, AOT_EAGER)
    assert list(table.steps) == [(1, 512)] and table.compiled_keys == 2, "one rebuild"
    torch._dynamo.reset()


@needs_kernels
def test_compiled_shapes_measurement_reports_keys_times_and_exactness(tmp_path):
    import json

    from benchmarks.speed import compiled_shapes
    from tests.helpers.tiny_models import char_tokenizer

    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    model.save_pretrained(tmp_path / "saved")
    char_tokenizer().save_pretrained(tmp_path / "saved")
    torch._dynamo.reset()
    argv = ["--quantized", str(tmp_path / "saved"), "--calls", "1x4,3x4,4x4", "--backend", "aot_eager", "--out", str(tmp_path)]
    paths = compiled_shapes.main(argv)
    torch._dynamo.reset()
    report = json.loads(open(paths[0]).read())
    assert [r["key"] for r in report["rows"]] == [[1, 512], [4, 512], [4, 512]]
    assert [r["new_key"] for r in report["rows"]] == [True, True, False] and report["all_equal"]
    with pytest.raises(SystemExit):
        compiled_shapes.main(["--quantized", ".", "--calls", "9x4"])


def test_the_mixed_sequence_covers_batch_sizes_1_to_4_and_prompts_of_5_to_2000_tokens():
    from benchmarks.speed.compiled_mixed import sequence
    from tests.helpers.tiny_models import char_tokenizer

    batches = sequence(char_tokenizer(), 20, seed=0)
    assert len(batches) == 20
    assert {len(b) for b in batches} == {1, 2, 3, 4}
    lengths = {len(row) for b in batches for row in b}
    assert min(lengths) == 5 and max(lengths) == 2000
    assert sequence(char_tokenizer(), 20, seed=0) == batches != sequence(char_tokenizer(), 20, seed=1)


@needs_kernels
def test_rows_left_after_others_finish_move_to_a_smaller_warm_batch_with_the_same_tokens(tmp_path):
    """A 2-row compiled call whose row 1 stops at EOS: with the 1-row steps compiled, row 0 finishes in them
    (one shrink, no graph traced, the 2-row cache released with it), token for token what it gets without them."""
    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    ids, mask = left_padded([repeating_prompt(3, 26), repeating_prompt(4, 14)])
    options = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    free = compiled_greedy(model, ids, mask, 20, num_draft_tokens=0)
    eos = int(free[1, ids.shape[1] + 3])
    torch._dynamo.reset()
    with torch.no_grad():
        table = compiled_steps_for(model, AOT_EAGER)
        before = {
            name: model.generate(ids, quasar={**COMPILED, "num_draft_tokens": n}, eos_token_id=eos, **options)
            for name, n in (("plain", 0), ("spec", 4))
        }
        assert table.shrinks == 0 and set(table.steps) == {(2, 512)}, "no 1-row steps yet: the call keeps its batch"
        quasar_hf.warm_up(model, [1], num_draft_tokens=4, compile_config=AOT_EAGER, cache_folder=None, progress=False)
        assert table.ready(1, 512, {1, 5})
        with torch._dynamo.config.patch(error_on_recompile=True):
            after = {
                name: model.generate(ids, quasar={**COMPILED, "num_draft_tokens": n}, eos_token_id=eos, **options)
                for name, n in (("plain", 0), ("spec", 4))
            }
    assert table.shrinks == 2, "each call moved its last row to the 1-row steps"
    assert torch.equal(after["plain"], before["plain"]) and torch.equal(after["spec"], before["spec"])
    assert torch.equal(after["spec"], after["plain"])
    new_tokens = after["spec"][:, ids.shape[1] :]
    assert bool((new_tokens[1] == eos).any()) and not bool((new_tokens[0] == eos).any()), "row 1 stopped, row 0 went on"
    assert len(table.idle_caches[(2, 512)]) == 1 and len(table.idle_caches[(1, 512)]) == 1, "both caches given back"
    torch._dynamo.reset()


def test_the_mixed_run_times_every_variant_of_a_call_before_the_next_call(monkeypatch):
    """Variants interleave call by call, so a machine's drift during the run lands on all of them alike."""
    from benchmarks.speed import compiled_mixed

    order = []

    class Stats:
        prefill_time_s = 0.0

    class Out:
        def __init__(self, ids):
            self.sequences, self.quasar_stats = torch.cat([ids, ids[:, :2]], 1), Stats()

    class Model:
        def generate(self, ids, quasar, **options):
            order.append((ids.shape[0], str(quasar)))
            return Out(ids)

    variants = {"a": ({"compile": True}, True), "b": (True, False)}
    monkeypatch.setattr(compiled_mixed, "VARIANTS", variants)
    runs = compiled_mixed.run_interleaved(Model(), [[[5, 6]], [[1, 2, 3], [4]]], new_tokens=2, pad=0)
    assert order == [(1, "{'compile': True}")] * 2 + [(1, "True")] + [(2, "{'compile': True}")] * 2 + [(2, "True")]
    assert [len(runs[name]) for name in variants] == [2, 2]
    assert runs["a"][1]["tokens"] == 4 and "repeat_s" in runs["a"][0] and "repeat_s" not in runs["b"][0]


def test_rows_about_to_finish_are_not_moved(tmp_path):
    """A move copies every kept slot of the rows left: it is offered only when they owe enough tokens."""
    from quasar_hf.speculative.static_cache import MOVE_SLOTS_PER_STEP, StaticVerifierCache

    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    asked = []
    cache = StaticVerifierCache(model, 4, torch.device("cpu"), 512, shrink=lambda left, allocated: asked.append(left))
    with torch.no_grad():
        cache.forward(torch.ones(4, 2 * MOVE_SLOTS_PER_STEP, dtype=torch.long), last_only=True)
    cache.select_rows(torch.tensor([0, 1, 2]), tokens_left=1)  # 512 slots for 1 token: not offered
    assert asked == []
    cache.select_rows(torch.tensor([0, 1]), tokens_left=2)  # 512 slots for 2 tokens: worth a move
    cache.select_rows(torch.tensor([0]))  # no budget known: offered
    assert asked == [2, 1] and cache.batch_size == 1
