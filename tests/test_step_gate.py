"""The step gate: how much of a batch's drafts a step verifies, from measured step costs; output unchanged."""

from __future__ import annotations

import pytest
import torch

from quasar_hf import QuasarGenerationConfig
from quasar_hf.speculative import NgramDrafter, speculative_generate
from quasar_hf.speculative.auto_drafter import AutoDrafter, auto_factory
from quasar_hf.speculative.drafters import DraftSetup
from quasar_hf.speculative.left_padding import left_padded
from quasar_hf.speculative.step_gate import StepGate, frontier_progress
from tests.helpers.tiny_models import char_tokenizer, tiny_model

GREEDY = DraftSetup(False, None, None, torch.device("cpu"))


def gate_with(costs: dict, accepted: float, drafted: float = 10.0) -> StepGate:
    gate = StepGate(decay=0.5)
    for (rows, width), seconds in costs.items():
        gate.record(rows, width, seconds)
    gate.accepted_mass["ngram"], gate.drafted_mass["ngram"] = accepted, drafted
    return gate


def test_a_wide_step_that_costs_more_than_its_drafts_give_is_verified_plain():
    costs = {(4, 0): 0.013, (4, 5): 0.031}  # SmolLM2, 4 rows, compiled: 31 ms verifying 6 tokens per row
    ngram = ["ngram"] * 4
    # 4 rows x (1 + f * 5) tokens in 31 ms beats 4 in 13 ms only when f > 0.28
    assert gate_with(costs, accepted=1.0).width([5, 5, 5, 5], ngram) == 0
    assert gate_with(costs, accepted=5.0).width([5, 5, 5, 5], ngram) == 5
    # one row's draft widens all four: alone it cannot pay for the wide step
    assert gate_with(costs, accepted=9.0).width([5, 0, 0, 0], ["ngram", "none", "none", "none"]) == 0


def test_the_gate_truncates_to_a_cheaper_width_and_is_off_at_min_gain_zero():
    costs = {(1, 0): 0.010, (1, 1): 0.0105, (1, 5): 0.030}  # eager: a wide step costs what it verifies
    gate = gate_with(costs, accepted=3.0)  # f = 0.3: width 1 gives 1.3 tokens in 10.5 ms, width 5 2.5 in 30
    assert gate.width([5], ["ngram"]) == 1 and gate.truncated_steps == 1
    gate.min_gain = 0.0
    assert gate.width([5], ["ngram"]) == 5
    assert gate.width([0, 0], ["none", "none"]) == 0


def test_unmeasured_widths_are_tried_once_and_the_plain_cost_is_probed():
    gate = StepGate()
    assert gate.width([3, 1], ["ngram", "ngram"]) == 3  # nothing measured: draft, and measure it
    gate.record(2, 3, 0.02)
    assert gate.width([3, 1], ["ngram", "ngram"]) == 0 and gate.withheld_steps == 1  # the baseline, once
    gate.record(2, 0, 0.01)
    assert gate.width([2, 2], ["ngram", "ngram"]) == 2  # a new width: tried
    assert gate.to_dict()["step_ms"] == {"2x0": 10.0, "2x3": 20.0}


def test_padded_steps_share_one_cost_so_one_measurement_prices_every_width():
    """A static cache pads every verify step to its draft width: a 2-token draft costs what a 5-token one does, so
    the gate never probes other widths and never truncates (fewer tokens at the same cost); plain or whole."""
    gate = StepGate(decay=0.5, padded_width=5)
    gate.record(4, 0, 0.011)
    gate.record(4, 2, 0.031)  # a step whose longest draft was 2 tokens ran the padded 5-token step
    assert gate.to_dict()["step_ms"] == {"4x0": 11.0, "4x5": 31.0}
    gate.accepted_mass["ngram"], gate.drafted_mass["ngram"] = 9.0, 10.0
    assert gate.width([3, 5, 5, 5], ["ngram"] * 4) == 5 and gate.truncated_steps == 0  # measured: no probe at 3
    gate.accepted_mass["ngram"] = 1.0
    assert gate.width([5, 5, 5, 5], ["ngram"] * 4) == 0  # 4 x 1.5 tokens in 31 ms < 4 in 11 ms
    unpadded = gate_with({(4, 0): 0.011, (4, 2): 0.031}, accepted=9.0)
    assert unpadded.width([5, 5, 5, 5], ["ngram"] * 4) == 5 and (4, 5) not in unpadded.seconds  # a new width: tried


def test_the_frontier_moves_as_the_slowest_row_does():
    """A batched call lasts until its last row is done: the expected drop of the most tokens any row still owes,
    each draft right whole or not at all (rows independent), not the sum of the rows' tokens."""
    assert frontier_progress([10] * 4, [5] * 4, [0.5] * 4) == pytest.approx(1 + 5 / 16)  # all four right: 1 / 16
    assert frontier_progress([10] * 4, [0] * 4, [0.0] * 4) == 1.0  # a plain step
    assert frontier_progress([10, 10, 10, 10], [5, 5, 5, 0], [1.0, 1.0, 1.0, 0.0]) == 1.0  # the draft-less row lags
    assert frontier_progress([10, 10, 10, 4], [5, 5, 5, 0], [1.0, 1.0, 1.0, 0.0]) == 6.0  # ... unless it is ahead


def test_with_budgets_the_gate_verifies_only_what_moves_the_frontier():
    costs = {(4, 0): 0.0116, (4, 5): 0.0292}  # SmolLM2 compiled, 4 rows: plain against a padded 5-draft verify step
    ngram = ["ngram"] * 4
    gate = gate_with(costs, accepted=5.0)  # f = 0.5: summed, 4 x 3.5 tokens in 29 ms beat 4 in 11.6 ms
    gate.padded_width = 5
    assert gate.width([5, 5, 5, 5], ngram) == 5
    assert gate.width([5, 5, 5, 5], ngram, budgets=[60] * 4) == 0  # the frontier: 1 + 5/16 tokens in 29 ms
    gate.accepted_mass["ngram"] = 9.8  # f = 0.98: all four right 92 % of the time
    assert gate.width([5, 5, 5, 5], ngram, budgets=[60] * 4) == 5
    assert gate.width([5, 5, 5, 0], ngram, budgets=[60] * 4) == 0  # the row without a draft sets the pace
    assert gate.width([5, 5, 5, 0], ngram, budgets=[60, 60, 60, 40]) == 5  # it is 20 tokens ahead


def test_auto_gives_the_gate_the_padded_width_of_the_call():
    drafter = AutoDrafter(NgramDrafter(3), None, 3)
    drafter.start([torch.tensor([1, 2]), torch.tensor([7, 8])], DraftSetup(False, None, None, torch.device("cpu"), 3))
    assert drafter.gate.padded_width == 3
    drafter.start([torch.tensor([1, 2]), torch.tensor([7, 8])], GREEDY)
    assert drafter.gate.padded_width is None


def test_auto_withholds_whole_drafts_and_scores_them_against_what_was_emitted():
    gate = gate_with({(2, 0): 0.01, (2, 3): 0.05}, accepted=0.0)
    drafter = AutoDrafter(NgramDrafter(3), None, 3, policy={"min_gain": 0.0}, gate=gate)
    drafter.start([torch.tensor([1, 2]), torch.tensor([7, 8])], GREEDY)
    rows = [torch.tensor([1, 2, 3, 1, 2]), torch.tensor([7, 8, 9, 7, 8])]
    draft = drafter.propose(rows, [3, 3])  # both rows find [3, 1, 2] / [9, 7, 8], not worth 5x a plain step
    assert draft.tokens.shape[1] == 0 and drafter.steps_by_source == {"ngram": 0, "model": 0, "none": 2}
    drafter.on_accept(torch.tensor([0, 0]))
    before = gate.drafted_mass["ngram"]
    drafter.propose([torch.cat([rows[0], torch.tensor([3])]), torch.cat([rows[1], torch.tensor([5])])], [3, 3])
    # row 1's draft is decided (9 != 5: 0 of 3 right); row 0's (3 so far) waits for the rest
    assert gate.drafted_mass["ngram"] == pytest.approx(0.5 * before + 3)
    assert list(drafter._shadows) == [0]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", layers=2, seed=5).eval()


def ids_of(text):
    return char_tokenizer()(text, return_tensors="pt").input_ids


def test_a_gated_batch_equals_plain_greedy(tiny):
    """A gate that withholds every draft once it has measured the costs (min_gain 100), and one that
    never does: both give plain batched greedy's tokens."""
    prompts = [ids_of(t) for t in ("abcabcabcabc", "the cat sat on the mat; the cat", "xyz")]
    ids, mask = left_padded(prompts, pad=96)
    plain = tiny.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=96)
    for gate in ({"min_gain": 100.0}, False):
        drafter = auto_factory(tiny, QuasarGenerationConfig(drafter="auto", drafter_kwargs={"gate": gate}))
        out = speculative_generate(
            tiny, ids, mask, max_new_tokens=20, do_sample=False, pad_token_id=96, quasar_config={"drafter": drafter}
        )
        assert torch.equal(out, plain)
        assert (drafter.gate.withheld_steps > 0) == (gate is not False)


def test_one_prompt_is_left_to_its_policy(tiny):
    """A single prompt's draft widens only its own step: the gate never withholds it, whatever min_gain."""
    drafter = auto_factory(tiny, QuasarGenerationConfig(drafter="auto", drafter_kwargs={"gate": {"min_gain": 100.0}}))
    ids = ids_of("abcabcabcabcabc")
    out = speculative_generate(tiny, ids, max_new_tokens=20, do_sample=False, quasar_config={"drafter": drafter})
    assert torch.equal(out, tiny.generate(ids, max_new_tokens=20, do_sample=False))
    assert drafter.gate.withheld_steps == 0 and drafter.steps_by_source["ngram"] > 0


def test_seeded_sampling_with_the_default_drafter_repeats(tiny):
    """Sampling decides nothing from a clock: the same seed gives the same tokens on every run."""
    ids, mask = left_padded([ids_of("abcabcabcabc"), ids_of("the cat sat")], pad=96)
    runs = [
        speculative_generate(
            tiny,
            ids,
            mask,
            max_new_tokens=16,
            do_sample=True,
            top_k=8,
            pad_token_id=96,
            generator=torch.Generator().manual_seed(3),
        )
        for _ in range(3)
    ]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_bad_gate_options_name_the_valid_ones(tiny):
    with pytest.raises(ValueError, match="min_gain, decay"):
        auto_factory(tiny, QuasarGenerationConfig(drafter="auto", drafter_kwargs={"gate": {"speed": 2}}))
    with pytest.raises(ValueError, match="True, False or a dict"):
        auto_factory(tiny, QuasarGenerationConfig(drafter="auto", drafter_kwargs={"gate": "on"}))
