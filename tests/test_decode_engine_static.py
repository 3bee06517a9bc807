"""The serving engine over a static cache and compiled steps: rows join and leave one preallocated batch.

A greedy row gives the tokens of plain decoding in the same mode (static cache eager, or compiled steps) alone,
however rows join, leave and move between batch sizes; a warmed engine traces no graph while rows come and go;
closing the holes of a long-lived batch (`pack`) and right-aligning a longer joining row change no row's bits.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers import DynamicCache

from quasar_hf import compat
from quasar_hf.speculative.engine import DecodeEngine
from quasar_hf.speculative.prompt_cache import PromptCache
from quasar_hf.speculative.static_buffers import FreshBuffers
from quasar_hf.speculative.static_cache import StaticVerifierCache
from quasar_hf.speculative.warm_up import warm_up
from tests.helpers.compiled_steps import AOT_EAGER
from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny
from tests.test_decode_engine import Row, add, drain, prompts

needs_kernels = pytest.mark.kernels("rowstable_linear")
MODES = {"static": {"cache_implementation": "static"}, "compiled": {"compile": AOT_EAGER}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny W8A8 model of the dynamic engine's tests (wide initialisation: its greedy text varies)."""
    return quantize_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("base"), initializer_range=0.3))


def plain_alone(model, ids: list[int], max_new_tokens: int, mode: dict) -> list[int]:
    """Plain greedy decoding (no drafts) of one prompt in the same mode."""
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, quasar={**mode, "num_draft_tokens": 0}
    )
    return out[0, len(ids) :].tolist()


def allocated_rows(engine: DecodeEngine) -> int:
    return 0 if engine.run is None else engine.run.verifier.slot_mask.shape[0]


@needs_kernels
@pytest.mark.parametrize("mode", ["static", "compiled"])
def test_static_rows_equal_plain_decoding_alone_however_they_join_and_leave(model, mode):
    torch._dynamo.reset()
    quasar = MODES[mode]
    engine = DecodeEngine(model)
    ids = prompts(11, seed=7)
    ids[3] = ids[3] * 3  # a row longer than the batch so far: the running rows shift right to take it
    budgets = [30, 5, 22, 9, 40, 3, 17, 26, 12, 35, 8]
    rows = [Row(p, n) for p, n in zip(ids, budgets)]
    sizes = []
    add(engine, model, rows[0], quasar)
    engine.step()
    for row in rows[1:6]:
        add(engine, model, row, quasar)
        sizes.append(allocated_rows(engine))
        engine.step()
    for row in rows[6:]:
        engine.step()
        add(engine, model, row, quasar)
        sizes.append(allocated_rows(engine))
    while engine.rows:
        engine.step()
        sizes.append(allocated_rows(engine))
    assert 8 in sizes and min(s for s in sizes if s) < 8, sizes  # it grew to 8 rows and moved back down
    for row, prompt, budget in zip(rows, ids, budgets):
        assert row.error is None and row.tokens == plain_alone(model, prompt, budget, quasar), f"prompt {prompt[:6]}..."
    torch._dynamo.reset()


@needs_kernels
def test_a_warmed_engine_traces_no_graph_while_rows_join_leave_and_move(model):
    torch._dynamo.reset()
    context = model.config.max_position_embeddings  # a server warmed for requests as long as the context (its
    # --max-model-len) compiles a larger cache than its short requests need: they run there, compiling nothing
    report = warm_up(
        model, batch_sizes=[1, 2, 4, 8], max_length=context, compile_config=AOT_EAGER, cache_folder=None, progress=False
    )
    assert report.shapes[0][1] == 2 * context
    graphs = compat.graphs_built()
    engine = DecodeEngine(model)
    rows = [Row(p, n) for p, n in zip(prompts(9, seed=8), [12, 4, 20, 7, 16, 3, 9, 14, 6])]
    for row in rows:
        add(engine, model, row, MODES["compiled"])
        engine.step()
    drain(engine)
    assert all(row.error is None and row.tokens for row in rows)
    assert compat.graphs_built() == graphs
    torch._dynamo.reset()


def _cache_with_holes(model) -> StaticVerifierCache:
    """Two rows after a prefill and three verify steps whose rejected drafts left holes in both rows."""
    cache = StaticVerifierCache(model, 2, torch.device("cpu"), 256, buffers=FreshBuffers(model, 256))
    cache.forward(torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]]), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
    for step, keep in enumerate(([1, 3], [4, 2], [2, 2])):
        cache.forward(torch.arange(4)[None].repeat(2, 1) + 20 + step)
        cache.keep_accepted(torch.tensor(keep), 4)
    return cache


def test_packing_a_static_batch_closes_its_holes_and_changes_no_bits(model):
    packed, reference = _cache_with_holes(model), _cache_with_holes(model)
    holes = int((reference.slot_mask[:, : reference.length] == 0).sum())
    packed.pack()
    assert holes > 0 and packed.length == int(packed.valid_len.max()) < reference.length
    assert torch.equal(packed.valid_len, reference.valid_len)
    chunk = torch.tensor([[40, 41, 42], [50, 51, 52]])
    assert torch.equal(packed.forward(chunk), reference.forward(chunk))


def test_a_longer_row_joins_right_aligned_and_every_row_keeps_its_bits(model):
    def alone(ids: list[int]) -> StaticVerifierCache:
        cache = StaticVerifierCache(model, 1, torch.device("cpu"), 256, buffers=FreshBuffers(model, 256))
        cache.forward(torch.tensor([ids]))
        return cache

    short, long = [3, 4, 5], prompts(1, seed=2)[0] * 2
    chunk = torch.tensor([[11, 12, 13], [21, 22, 23]])
    expected = [alone(ids).forward(chunk[i : i + 1])[0] for i, ids in enumerate((short, long))]
    batch = alone(short)
    batch.join(alone(long))  # longer than the batch: the running row shifts right
    assert batch.slot_mask.shape[0] == 2 and batch.length == len(long)
    got = batch.forward(chunk)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def dynamic_cache(layers) -> DynamicCache:
    cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys.clone(), values.clone(), index)
    return cache


@needs_kernels
def test_a_compiled_served_turn_reuses_the_last_turns_keys_as_compiled_generate_continues_from_them(model):
    """The compiled engine stores a finished row's keys and values (its prompt and answer, as eager decoding computes
    them for this model) and the next turn continues from them, giving the tokens compiled plain decoding gives
    continuing from that cache offline (`generate(past_key_values=...)` over compiled steps)."""
    torch._dynamo.reset()
    turn_1 = prompts(1, seed=11)[0]
    prompt_cache = PromptCache(max_bytes=10**8)
    engine = DecodeEngine(model, prompt_cache)
    first = Row(turn_1, 12)
    add(engine, model, first, MODES["compiled"])
    drain(engine)
    eager = model.generate(torch.tensor([turn_1]), max_new_tokens=12, do_sample=False, quasar=False, return_dict_in_generate=True)
    assert first.tokens == eager.sequences[0, len(turn_1) :].tolist()
    turn_2 = turn_1 + first.tokens + [40, 41, 42, 5, 6, 7, 8] * 3
    hit = prompt_cache.longest_prefix(turn_2)
    assert hit.tokens == len(turn_1) + len(first.tokens) - 1  # all but the last token's keys were computed
    for (keys, values), (eager_keys, eager_values) in zip(hit.layers, compat.cache_key_values(eager.past_key_values)):
        assert torch.equal(keys, eager_keys[:, :, : hit.tokens]) and torch.equal(values, eager_values[:, :, : hit.tokens])
    second = Row(turn_2, 20)
    add(engine, model, second, MODES["compiled"])
    drain(engine)
    assert second.request.reused_tokens == hit.tokens
    offline = model.generate(
        torch.tensor([turn_2]),
        max_new_tokens=20,
        do_sample=False,
        past_key_values=dynamic_cache(hit.layers),
        quasar={**MODES["compiled"], "num_draft_tokens": 0},
    )
    assert second.tokens == offline[0, len(turn_2) :].tolist()
    eager_continuation = model.generate(
        torch.tensor([turn_2]), max_new_tokens=20, do_sample=False, past_key_values=dynamic_cache(hit.layers), quasar=False
    )
    assert second.tokens == eager_continuation[0, len(turn_2) :].tolist()  # the seeding is the dynamic cache's too
    torch._dynamo.reset()


@needs_kernels
def test_a_seeded_sampled_row_gives_its_text_alone_and_beside_other_rows_in_the_static_engine(model):
    """A sampled row over the static cache chooses each token with its own uniforms (token_uniforms.py): the same
    text alone as beside greedy and sampled rows that join and leave, drafting with the batch's drafter."""
    quasar = MODES["static"]
    target_ids = prompts(1, seed=21)[0]

    def sampled_alone() -> list[int]:
        engine = DecodeEngine(model)
        row = Row(target_ids, 20, seed=5, temperature=0.4)
        add(engine, model, row, quasar)
        drain(engine)
        return row.tokens

    engine = DecodeEngine(model)
    others = [
        Row(p, n, seed=(None if i % 2 else 50 + i)) for i, (p, n) in enumerate(zip(prompts(5, seed=22), [6, 25, 9, 14, 30]))
    ]
    add(engine, model, others[0], quasar)
    engine.step()
    target = Row(target_ids, 20, seed=5, temperature=0.4)
    add(engine, model, target, quasar)
    for other in others[1:]:
        engine.step()
        add(engine, model, other, quasar)
    drain(engine)
    assert all(row.error is None for row in [target, *others])
    assert len(target.tokens) == 20 and target.tokens == sampled_alone()
