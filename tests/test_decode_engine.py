"""DecodeEngine: rows join and leave a running batch, and each row decodes exactly what it decodes alone.

Greedy rows give plain greedy decoding's tokens whether they join an empty engine, a batch of 7 rows, or a
batch whose rows finish around them; a sampled row with a seed gives the same text alone and beside 7 others;
sampled rows of a mixed batch follow the target distribution (chi-square, as tests/test_spec_sampling.py).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import GenerationConfig

import quasar_hf.speculative.row_rules as row_rules_module
from quasar_hf.speculative.admission import AdmissionPolicy
from quasar_hf.speculative.batch_request import BatchRequest
from quasar_hf.speculative.batcher import RequestBatcher
from quasar_hf.speculative.engine import DecodeEngine
from quasar_hf.speculative.request_config import request_quasar_config
from quasar_hf.speculative.row_aligned_cache import RowAlignedCache
from quasar_hf.speculative.token_uniforms import choose_token
from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny
from tests.helpers.sampling_stats import VOCAB, chi_square_p_value, exact_joint, grounded_prompt, peaked_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny Quasar W8A8 model (what the server runs: INT8 GEMMs and row-stable attention, so a row's bits do not
    depend on the batch), initialised wide enough that its greedy text varies (the default one repeats a token,
    which would hide wrong attention from a token comparison)."""
    return quantize_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("base"), initializer_range=0.3))


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 4-60 tokens, each a repeated random phrase (so n-gram drafts are sometimes right)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        phrase = torch.randint(3, 250, (int(torch.randint(2, 9, (1,), generator=generator)),), generator=generator)
        repeats = int(torch.randint(2, 8, (1,), generator=generator))
        out.append(phrase.repeat(repeats).tolist()[:60])
    return out


class Row:
    """One request and what it received."""

    def __init__(self, ids: list[int], max_new_tokens: int, seed: int | None = None, **options) -> None:
        self.tokens: list[int] = []
        self.error = "not finished"
        self.done = threading.Event()
        sampled = {"do_sample": True, "temperature": 1.3, "top_k": 0} if seed is not None else {"do_sample": False}
        config = GenerationConfig(max_new_tokens=max_new_tokens, **{**sampled, **options})
        self.request = BatchRequest(list(ids), config, self.tokens.extend, self._finish)
        if seed is not None:
            self.request.generator = torch.Generator().manual_seed(seed)

    def _finish(self, error) -> None:
        self.error = error
        self.done.set()


def add(engine: DecodeEngine, model, row: Row, quasar: dict | None = None) -> None:
    engine.add(row.request, request_quasar_config(model, row.request.generation_config, quasar))


def drain(engine: DecodeEngine) -> None:
    while engine.rows:
        engine.step()


def accept_every_draft(uniforms, tokens, scores):
    """The mistake: keep every draft token, then choose the bonus token."""
    values = uniforms.peek(len(tokens) + 1)
    chosen = choose_token(scores[len(tokens)], values[len(tokens)])
    uniforms.advance(len(tokens) + 1)
    return len(tokens), chosen


def plain(model, ids: list[int], max_new_tokens: int, **options) -> list[int]:
    """Plain greedy decoding of the same model (a Quasar model with Quasar off)."""
    if getattr(model.config, "quantization_config", None) is not None:
        options["quasar"] = False
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **options)
    return out[0, len(ids) :].tolist()


def alone(model, ids: list[int], max_new_tokens: int) -> list[int]:
    return plain(model, ids, max_new_tokens)


@pytest.mark.parametrize("drafter", ["ngram", "auto"])
def test_greedy_rows_equal_plain_decoding_however_they_join_and_leave(model, drafter):
    quasar = {"drafter": drafter}
    engine = DecodeEngine(model)
    ids = prompts(12, seed=1)
    budgets = [30, 5, 22, 9, 40, 3, 17, 26, 12, 35, 8, 20]
    rows = [Row(p, n) for p, n in zip(ids, budgets)]
    add(engine, model, rows[0], quasar)  # joins an empty engine
    engine.step()
    for row in rows[1:7]:
        add(engine, model, row, quasar)
    engine.step()
    engine.step()
    add(engine, model, rows[7], quasar)  # joins a running batch of 7 rows (some finish around it)
    for row in rows[8:]:
        engine.step()
        add(engine, model, row, quasar)  # rows keep arriving while others leave
    drain(engine)
    for row, prompt, budget in zip(rows, ids, budgets):
        assert row.error is None and row.tokens == alone(model, prompt, budget), f"prompt {prompt[:6]}..."


def test_joined_rows_compute_the_bits_each_row_computes_alone(model):
    """Caches filled alone, joined (a long row and a short one), then one verify forward: each row's logits equal
    its own cache's, bit for bit."""
    kwargs = {"quasar_rowstable": True}
    long, short = prompts(1, seed=9)[0] * 2, [9, 8, 7]

    def filled(ids: list[int]) -> RowAlignedCache:
        cache = RowAlignedCache(model, 1, torch.device("cpu"), kwargs)
        cache.forward(torch.tensor([ids]))
        return cache

    chunks = torch.tensor([[11, 12, 13], [21, 22, 23]])
    expected = [filled(ids).forward(chunks[i : i + 1])[0] for i, ids in enumerate((long, short))]
    joined = filled(long)
    joined.join(filled(short))
    assert joined.valid_len.tolist() == [len(long), 3] and joined.slot_mask.shape[1] == len(long)
    got = joined.forward(chunks)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    wider = filled(short)
    wider.join(filled(long))  # the joining row is the longer one: the running rows get holes before theirs
    got = wider.forward(chunks.flip(0))
    assert torch.equal(got[0], expected[1]) and torch.equal(got[1], expected[0])


def test_a_long_prompt_joining_short_rows_widens_the_cache_and_changes_no_row(model):
    engine = DecodeEngine(model)
    short, long = [5, 6, 7, 5, 6, 7], prompts(1, seed=3)[0] * 3
    first, second = Row(short, 24), Row(long[:150], 16)
    add(engine, model, first)
    engine.step()
    add(engine, model, second)
    drain(engine)
    assert first.tokens == alone(model, short, 24) and second.tokens == alone(model, long[:150], 16)


def test_a_sampled_row_gives_the_same_text_alone_and_beside_seven_others(model):
    target_ids = prompts(1, seed=4)[0]

    def sampled_alone() -> list[int]:
        engine = DecodeEngine(model)
        row = Row(target_ids, 24, seed=99)
        add(engine, model, row)
        drain(engine)
        return row.tokens

    engine = DecodeEngine(model)
    others = [Row(p, 20, seed=(None if i % 2 else i)) for i, p in enumerate(prompts(7, seed=5))]
    for other in others[:4]:
        add(engine, model, other)
    engine.step()
    target = Row(target_ids, 24, seed=99)
    add(engine, model, target)
    for other in others[4:]:
        engine.step()
        add(engine, model, other)
    drain(engine)
    reference = sampled_alone()
    assert len(reference) == 24 and target.tokens == reference
    assert sampled_alone() == reference
    different_seed = Row(target_ids, 24, seed=100)
    engine = DecodeEngine(model)
    add(engine, model, different_seed)
    drain(engine)
    assert different_seed.tokens != reference


def test_sampled_rows_of_different_settings_give_their_text_alone_in_one_batch(model):
    """Rows whose warpers are stacked (equal settings) beside rows whose are not (another temperature, top-k, a
    repetition penalty): each sampled row's text with its seed is its text alone (speculative/row_scores.py)."""
    ids = prompts(7, seed=12)
    settings = [
        {"seed": 1, "temperature": 0.7, "top_p": 0.8},
        {"seed": 2, "temperature": 0.7, "top_p": 0.8},
        {"seed": 3, "temperature": 1.3, "top_p": 0.8},  # only the temperature differs from the rows above
        {"seed": 4, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.3},
        {"seed": 5, "temperature": 0.7, "top_p": 0.8, "top_k": 20},
        {"seed": 6, "temperature": 0.9, "min_p": 0.05},
        {},  # a greedy row
    ]

    def sampled_alone(i: int) -> list[int]:
        engine = DecodeEngine(model)
        row = Row(ids[i], 20, **settings[i])
        add(engine, model, row)
        drain(engine)
        return row.tokens

    engine = DecodeEngine(model)
    rows = [Row(p, 20, **options) for p, options in zip(ids, settings)]
    for row in rows[:3]:
        add(engine, model, row)
    engine.step()
    for row in rows[3:]:
        add(engine, model, row)
    drain(engine)
    assert rows[6].tokens == alone(model, ids[6], 20)
    for i in range(6):
        assert rows[i].error is None and rows[i].tokens == sampled_alone(i), settings[i]


def test_rows_with_different_settings_share_steps(model):
    engine = DecodeEngine(model)
    ids = prompts(4, seed=6)
    rows = [
        Row(ids[0], 16),
        Row(ids[1], 16, seed=3, top_p=0.9),
        Row(ids[2], 16, repetition_penalty=1.3),
        Row(ids[3], 16),
    ]
    add(engine, model, rows[0])
    add(engine, model, rows[1])
    add(engine, model, rows[2])
    add(engine, model, rows[3], {"num_draft_tokens": 0})  # Quasar off for this row: plain decode steps
    assert engine.rows == 4
    drain(engine)
    assert rows[0].tokens == alone(model, ids[0], 16) and rows[3].tokens == alone(model, ids[3], 16)
    assert rows[2].tokens == plain(model, ids[2], 16, repetition_penalty=1.3)
    assert len(rows[1].tokens) == 16 and all(row.error is None for row in rows)


def test_a_row_with_other_quasar_options_waits_for_the_running_rows(model):
    engine = DecodeEngine(model)
    add(engine, model, Row([5, 6, 7, 8], 8), {"drafter": "ngram"})
    other = request_quasar_config(model, GenerationConfig(max_new_tokens=4), {"drafter": "ngram", "max_ngram_size": 2})
    same = request_quasar_config(model, GenerationConfig(max_new_tokens=4), {"drafter": "ngram", "num_draft_tokens": 2})
    assert not engine.can_join(other) and engine.can_join(same)
    drain(engine)
    assert engine.can_join(other)


def test_a_request_that_arrives_while_others_decode_streams_before_they_end(model):
    batcher = RequestBatcher(model)
    try:
        long, late = Row(prompts(1, seed=7)[0], 400), Row([40, 41, 42, 40, 41], 4)
        started = threading.Event()
        on_tokens = long.request.on_tokens
        long.request.on_tokens = lambda tokens: (on_tokens(tokens), started.set())
        batcher.submit(long.request)
        assert started.wait(60)
        submitted = len(long.tokens)
        batcher.submit(late.request)
        assert late.done.wait(60)
        assert len(long.tokens) < 400 and not long.done.is_set(), "the late request waited for the running row"
        assert late.tokens == alone(model, [40, 41, 42, 40, 41], 4)
        assert long.done.wait(120) and long.tokens == alone(model, long.request.input_ids, 400)
        assert submitted < 400 and batcher.widest_step == 2
    finally:
        batcher.stop()


def test_admission_bounds_the_prompt_tokens_prefilled_between_two_steps(model):
    batcher = RequestBatcher(model, prefill_tokens_per_step=40)
    try:
        rows = [Row(p, 6) for p in prompts(6, seed=8)]
        for row in rows:
            batcher.submit(row.request)
        for row, prompt in zip(rows, prompts(6, seed=8)):
            assert row.done.wait(60) and row.error is None and row.tokens == alone(model, prompt, 6)
    finally:
        batcher.stop()


def sampled_in_mixed_batches(model, prompt, options: dict, samples: int) -> tuple[torch.Tensor, int]:
    """Counts of (t1, t2, t3) over `samples` sampled rows, each joining a running batch of greedy and sampled
    rows; and the draft tokens those steps verified."""
    ids = prompt[0].tolist()
    counts = torch.zeros(VOCAB**3)
    drafted = []
    engine = DecodeEngine(model, on_stats=lambda stats, rows: drafted.append(stats.drafted_tokens))
    quasar = {"drafter": "ngram", "num_draft_tokens": 3}
    done = 0
    while done < samples:
        add(engine, model, Row(ids[: 8 + done % 9], 5), quasar)
        batch = []
        for _ in range(7):
            row = Row(ids, 3, seed=done, **options)
            add(engine, model, row, quasar)
            batch.append(row)
            done += 1
            engine.step()
        drain(engine)
        for row in batch:
            t = row.tokens
            counts[t[0] * VOCAB**2 + t[1] * VOCAB + t[2]] += 1
    return counts, sum(drafted)


def test_sampled_rows_of_a_mixed_batch_follow_the_target_distribution(monkeypatch):
    """Each sample is a sampled row that joined a running batch of greedy and other sampled rows; accepting every
    draft (a classic mistake) must be rejected by the same test."""
    model = peaked_model(seed=1)
    prompt = grounded_prompt(model)
    options = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    target = exact_joint(model, prompt, {"do_sample": True, **options})
    counts, drafted = sampled_in_mixed_batches(model, prompt, options, 1200)
    assert drafted > 500 and chi_square_p_value(counts, target) > 1e-3
    monkeypatch.setattr(row_rules_module, "accept_by_uniforms", accept_every_draft)
    wrong, _ = sampled_in_mixed_batches(model, prompt, options, 1200)
    assert chi_square_p_value(wrong, target) < 1e-8


def test_a_sampled_rows_text_does_not_depend_on_what_is_drafted_for_it(model):
    """Each token is the one its uniform (by token index) chooses, so drafts of any length, from any drafter, or
    none give one text for one seed; the drafting runs here do accept drafts (else the test would prove nothing)."""
    ids = prompts(1, seed=4)[0]
    texts, accepted = [], []
    for quasar in ({"num_draft_tokens": 0}, {"drafter": "ngram", "num_draft_tokens": 2}, {"drafter": "ngram"}, {}):
        kept = []
        engine = DecodeEngine(model, on_stats=lambda stats, rows: kept.append(stats.accepted_tokens))
        row = Row(ids, 40, seed=7, temperature=0.3)
        add(engine, model, row, quasar)
        drain(engine)
        texts.append(row.tokens)
        accepted.append(sum(kept))
    assert len(texts[0]) == 40 and all(text == texts[0] for text in texts[1:])
    assert accepted[0] == 0 and min(accepted[1:]) > 0


def test_running_rows_keep_stepping_while_a_long_prompt_is_prefilled(model, monkeypatch):
    """A prompt with more new tokens than background_prefill_tokens, arriving while a row decodes, is prefilled in
    the prefill thread (slowed down here) while that row keeps stepping; both give their tokens alone."""
    original = DecodeEngine.prefill
    timeline: list[tuple[str, int]] = []

    def slow_prefill(self, request, config, prefix):
        run = original(self, request, config, prefix)
        if len(request.input_ids) > 40:
            timeline.append(("prefill starts", len(running.tokens)))
            time.sleep(1.0)
            timeline.append(("prefill ends", len(running.tokens)))
        return run

    monkeypatch.setattr(DecodeEngine, "prefill", slow_prefill)
    batcher = RequestBatcher(model, admission=AdmissionPolicy(background_prefill_tokens=40))
    try:
        running, long = Row(prompts(1, seed=10)[0], 300), Row(prompts(1, seed=11)[0] * 4, 12)
        started = threading.Event()
        on_tokens = running.request.on_tokens
        running.request.on_tokens = lambda tokens: (on_tokens(tokens), started.set())
        batcher.submit(running.request)
        assert started.wait(60)
        batcher.submit(long.request)
        assert long.done.wait(60) and running.done.wait(120)
        (_, before), (_, after) = timeline
        assert after > before, "the running row waited for the long prompt's prefill"
        assert long.error is None and long.tokens == alone(model, long.request.input_ids, 12)
        assert running.tokens == alone(model, running.request.input_ids, 300)
        # The prefill's thread is gone with it: a thread kept alive keeps its OpenMP team, which throttles libgomp's
        # spinning for every team (the decoding thread's steps then took twice as long, for good).
        for thread in [thread for thread in threading.enumerate() if thread.name.startswith("quasar-prefill")]:
            thread.join(5)
            assert not thread.is_alive(), "the prefill thread outlived its prefill"
    finally:
        batcher.stop()
