"""Processed scores of many rows stacked (speculative/row_scores.py) are the bits of one call per row.

The oracle is `reference_scores` (each item's own list on its own prefix, one call each, what the loop did
before). Items mix warper settings (temperatures, top-p, top-k, min-p), prefix lengths, a repetition penalty
beside warper-only rows, and processors that must never be stacked (an unknown class that looks at the other
rows, a subclass of a stackable warper).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from quasar_hf.speculative.row_scores import processed_scores, reference_scores, stack_key

VOCAB = 49_152  # SmolLM2's: a one-row reduction over it is split among threads, a sort is a real one


class CentredOnTheBatch(LogitsProcessor):
    """Unknown to row_scores, and its output depends on the rows called with it: stacked, it would change."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return scores - scores.mean(dim=0, keepdim=True) + 0.5 * scores


class OwnTopP(TopPLogitsWarper):
    """A subclass of a stackable warper (it may do anything): never stacked."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        return super().__call__(input_ids, scores) * (1.0 + input_ids.shape[-1] / 100)


def warpers(temperature: float, top_k: int | None = 50, top_p: float | None = 0.8) -> list:
    out: list = [TemperatureLogitsWarper(temperature)]
    if top_k is not None:
        out.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        out.append(TopPLogitsWarper(top_p))
    return out


def row_lists() -> list[LogitsProcessorList]:
    """One list per row, each a fresh object (as each request's generate prepares its own)."""
    return [
        LogitsProcessorList(warpers(0.7)),
        LogitsProcessorList(warpers(0.7)),  # the same settings as row 0: stacked with it
        LogitsProcessorList(warpers(1.3)),  # only the temperature differs
        LogitsProcessorList(warpers(0.7, top_p=0.95)),  # only top-p differs
        LogitsProcessorList(warpers(0.7, top_k=20)),  # only top-k differs
        LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), *warpers(0.7)]),  # reads its prefix, then warps
        LogitsProcessorList([CentredOnTheBatch(), *warpers(0.7, top_k=None)]),
        LogitsProcessorList([TemperatureLogitsWarper(0.7), OwnTopP(0.8)]),
        LogitsProcessorList([TemperatureLogitsWarper(0.9), MinPLogitsWarper(0.05), EpsilonLogitsWarper(3e-4)]),
        LogitsProcessorList([TemperatureLogitsWarper(0.9), TypicalLogitsWarper(0.9)]),
        LogitsProcessorList(),  # a greedy row: its logits as they are
    ]


def items(rows: list[LogitsProcessorList], positions: int, seed: int = 0):
    """Every row at `positions` verified positions (prefixes one token longer each), logits with ties."""
    generator = torch.Generator().manual_seed(seed)
    processors, prefixes, logits = [], [], []
    for r, lst in enumerate(rows):
        prompt = torch.randint(0, VOCAB, (5 + 7 * r,), generator=generator)
        for j in range(positions):
            processors.append(lst)
            prefixes.append(torch.cat([prompt, torch.randint(0, VOCAB, (j,), generator=generator)]))
            row = torch.randn(VOCAB, generator=generator) * 4
            row[:200] = float(row[0])  # ties at the top
            row[prefixes[-1][:3]] = float(row[5])  # and among the penalised tokens
            logits.append(row)
    return processors, prefixes, torch.stack(logits)


@pytest.mark.parametrize("positions", [1, 3])
def test_stacked_scores_are_the_bits_of_one_call_per_row(positions):
    processors, prefixes, logits = items(row_lists(), positions)
    before = logits.clone()
    got = processed_scores(processors, prefixes, logits)
    assert torch.equal(got, reference_scores(processors, prefixes, logits))
    assert torch.equal(logits, before)  # the logits are not changed in place


def test_rows_given_in_any_order_and_subsets_are_the_same_bits():
    processors, prefixes, logits = items(row_lists(), 2, seed=1)
    order = torch.randperm(len(processors), generator=torch.Generator().manual_seed(2)).tolist()[:13]
    processors, prefixes, logits = [processors[i] for i in order], [prefixes[i] for i in order], logits[order]
    assert torch.equal(processed_scores(processors, prefixes, logits), reference_scores(processors, prefixes, logits))


def test_stacked_scores_are_the_same_bits_on_two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a one-row sum splits across threads: what typical warping would get wrong stacked
    try:
        processors, prefixes, logits = items(row_lists(), 2, seed=3)
        assert torch.equal(processed_scores(processors, prefixes, logits), reference_scores(processors, prefixes, logits))
    finally:
        torch.set_num_threads(threads)


def test_settings_decide_what_is_stacked():
    assert stack_key(TemperatureLogitsWarper(0.7)) == stack_key(TemperatureLogitsWarper(0.7))
    assert stack_key(TemperatureLogitsWarper(0.7)) != stack_key(TemperatureLogitsWarper(0.8))
    assert stack_key(TopPLogitsWarper(0.8)) != stack_key(TopPLogitsWarper(0.8, min_tokens_to_keep=2))
    assert stack_key(TopKLogitsWarper(20)) != stack_key(TopKLogitsWarper(50))
    assert stack_key(TopPLogitsWarper(0.8, filter_value=0.0)) != stack_key(TopPLogitsWarper(0.8, filter_value=-0.0))
    assert stack_key(TopPLogitsWarper(0.8, filter_value=float("nan"))) is None
    assert stack_key(TopKLogitsWarper(20)) != stack_key(TopPLogitsWarper(0.8))
    for never in (
        OwnTopP(0.8),
        CentredOnTheBatch(),
        TypicalLogitsWarper(0.9),
        EtaLogitsWarper(3e-4),
        RepetitionPenaltyLogitsProcessor(1.1),
    ):
        assert stack_key(never) is None, type(never).__name__
    with_state = TemperatureLogitsWarper(0.7)
    with_state.seen = 3  # an attribute that is no setting: not known to be stateless
    assert stack_key(with_state) is None
    tensor_valued = TopPLogitsWarper(0.8)
    tensor_valued.filter_value = torch.tensor(-1.0)
    assert stack_key(tensor_valued) is None


def test_other_devices_take_the_reference_path(monkeypatch):
    """Off the CPU nothing is stacked (the kernels' row independence is checked on the CPU only)."""
    import quasar_hf.speculative.row_scores as row_scores

    monkeypatch.setattr(row_scores, "STACKING_DEVICES", ())
    calls = []
    monkeypatch.setattr(row_scores, "reference_scores", lambda *args: calls.append(args) or args[2])
    processors, prefixes, logits = items(row_lists()[:2], 1)
    row_scores.processed_scores(processors, prefixes, logits)
    assert len(calls) == 1


def test_rows_of_equal_settings_are_warped_in_one_call():
    """Eight items (four rows, two positions) of one setting: one sort for top-p, not eight."""
    processors, prefixes, logits = items([LogitsProcessorList(warpers(0.7)) for _ in range(4)], 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = processed_scores(processors, prefixes, logits)
    assert [event.name for event in profile.events()].count("aten::sort") == 1
    assert torch.equal(got, reference_scores(processors, prefixes, logits))


def lazily_and_fully_scored(seed: int):
    """Rows of several requests (greedy with and without a penalty, sampled with their own drafts and generators),
    drafts that are often accepted: (accept on fully processed scores, accept on verified_scores), each with its
    scores and the generators' states after."""
    from transformers import StoppingCriteriaList

    from quasar_hf.speculative.drafters import Draft
    from quasar_hf.speculative.row_rules import RowRules, accept
    from quasar_hf.speculative.row_scores import verified_scores
    from quasar_hf.speculative.token_uniforms import TokenUniforms

    vocab, k = 3000, 5
    generator = torch.Generator().manual_seed(seed)
    lists = [
        LogitsProcessorList(warpers(0.7, top_k=None, top_p=0.9)),
        LogitsProcessorList(warpers(0.7, top_k=None, top_p=0.9)),
        LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), *warpers(1.0, top_k=None, top_p=0.95)]),
        LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)]),  # greedy with a penalty
        LogitsProcessorList(),  # greedy
        LogitsProcessorList(warpers(1.2, top_k=20, top_p=None)),
    ]
    sampled = [True, True, True, False, False, True]
    lengths = torch.tensor([5, 3, 4, 5, 2, 0])
    sequences = [torch.randint(0, vocab, (6 + 3 * i,), generator=generator) for i in range(len(lists))]
    logits = torch.randn(len(lists), k + 1, vocab, generator=generator)
    tokens = torch.randint(0, vocab, (len(lists), k), generator=generator)
    for i in range(len(lists)):  # drafts that are usually the model's choice, sometimes not
        for j in range(k):
            logits[i, j, tokens[i, j]] += float(torch.rand((), generator=generator) * 12)
    draft = Draft(tokens=tokens * (torch.arange(k) < lengths[:, None]), lengths=lengths)

    def rules() -> list[RowRules]:
        made = []
        for i, lst in enumerate(lists):
            own = torch.Generator().manual_seed(seed * 10 + i) if sampled[i] else None
            uniforms = TokenUniforms(own) if sampled[i] else None
            made.append(RowRules(lst, StoppingCriteriaList(), sampled[i], own, 10_000, uniforms=uniforms))
        return made

    full_rules = rules()
    full = logits.clone()
    for i, n in enumerate(lengths.tolist()):
        for j in range(n + 1):
            prefix = torch.cat([sequences[i], draft.tokens[i, :j]])[None]
            full[i, j] = lists[i](prefix, logits[i, j][None].clone())[0]
    lazy_rules = rules()
    lazy = verified_scores(lazy_rules, sequences, draft, logits)

    def states(made: list[RowRules]) -> list:
        return [(r.generator.get_state(), r.uniforms.used) if r.generator is not None else None for r in made]

    fully = (accept(full_rules, draft, full), full, states(full_rules))
    return fully, (accept(lazy_rules, draft, lazy), lazy, states(lazy_rules))


@pytest.mark.parametrize("seed", range(6))
def test_scores_processed_only_where_acceptance_reads_them_give_the_same_tokens(seed):
    (full_out, full, full_states), (lazy_out, lazy, lazy_states) = lazily_and_fully_scored(seed)
    assert torch.equal(full_out[0], lazy_out[0]) and torch.equal(full_out[1], lazy_out[1])
    for i, n in enumerate(full_out[0].tolist()):
        assert torch.equal(full[i, : n + 1], lazy[i, : n + 1]), i  # what the loop emits with and stops on
    assert all(a is b or (torch.equal(a[0], b[0]) and a[1] == b[1]) for a, b in zip(full_states, lazy_states))


def test_the_checks_see_acceptances_past_the_first_position():
    """The drafts of these cases are accepted often enough that a row scored at its first position only would
    be caught: some rows accept two or more drafts."""
    accepted = [lazily_and_fully_scored(seed)[0][0][0] for seed in range(6)]
    assert sum(int((n >= 2).sum()) for n in accepted) >= 6
