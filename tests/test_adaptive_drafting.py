"""AdaptivePolicy (pure: no model, no clock) and the AdaptiveDrafter wrapper."""

from __future__ import annotations

import pytest
import torch

from quasar_hf.speculative import NgramDrafter, speculative_generate
from quasar_hf.speculative.adaptive import AdaptiveDrafter, AdaptivePolicy
from quasar_hf.speculative.drafters import Draft, DraftSetup
from tests.helpers.tiny_models import tiny_model

MS = 1e-3


def drafting_step(policy: AdaptivePolicy, accepted: int, draft_ms: float = 1.0, verify_ms: float = 10.0) -> None:
    k = policy.draft_length()
    policy.record([k], [min(accepted, k)], k * draft_ms * MS, verify_ms * MS)


def test_length_follows_transformers_heuristic():
    policy = AdaptivePolicy(max_tokens=6, initial_tokens=2, warmup_steps=100)
    drafting_step(policy, accepted=2)
    assert policy.length == 4  # all accepted: +2
    drafting_step(policy, accepted=4)
    assert policy.length == 6  # capped at max_tokens
    drafting_step(policy, accepted=1)
    assert policy.length == 5  # a rejection: -1
    for _ in range(10):
        drafting_step(policy, accepted=0)
    assert policy.length == 1  # never below min_tokens


def test_cost_rule_keeps_free_drafts_long_and_shortens_costly_ones():
    free = AdaptivePolicy(max_tokens=5, initial_tokens=5, warmup_steps=100, length_rule="cost")
    heuristic = AdaptivePolicy(max_tokens=5, initial_tokens=5, warmup_steps=100)
    for _ in range(6):  # two of five accepted, drafts nearly free (n-gram lookup)
        drafting_step(free, accepted=2, draft_ms=0.01)
        drafting_step(heuristic, accepted=2, draft_ms=0.01)
    assert heuristic.length <= 3  # -1 on every partial acceptance (+2 once a short draft is all accepted)
    assert free.length == 5  # the expected gain still grows with k: longer drafts cost almost nothing
    assert free.expected_gain(5) == max(free.expected_gain(k) for k in range(1, 6))
    costly = AdaptivePolicy(max_tokens=5, initial_tokens=5, warmup_steps=100, length_rule="cost")
    for _ in range(6):  # the same acceptance, but each draft token costs 40 % of a step
        drafting_step(costly, accepted=2, draft_ms=4.0)
    assert costly.length < 5 and costly.expected_gain(costly.length) == max(costly.expected_gain(k) for k in range(1, 6))


def test_batch_step_counts_as_full_acceptance_only_if_every_row_accepted_all():
    policy = AdaptivePolicy(max_tokens=5, initial_tokens=3, warmup_steps=100)
    policy.record([3, 3], [3, 1], 1 * MS, 10 * MS)
    assert policy.length == 2


def test_acceptance_estimate_is_geometric():
    policy = AdaptivePolicy(prior_weight=0.0, decay=0.5)
    policy.record([4], [2], MS, 10 * MS)  # 2 successes, 1 failure
    assert policy.acceptance == pytest.approx(2 / 3)
    policy.record([4], [4], MS, 10 * MS)  # 4 successes, no failure; old evidence halved
    assert policy.acceptance == pytest.approx((1 + 4) / (1.5 + 4))
    assert policy.expected_tokens(2) == pytest.approx(1 + policy.acceptance + policy.acceptance**2)


def test_expensive_drafts_that_are_rejected_pause_drafting_with_growing_pauses():
    policy = AdaptivePolicy(max_tokens=4, warmup_steps=2, pause_steps=3, max_pause_steps=6)
    policy.record([0], [0], 0.0, 10 * MS)  # a plain step: 10 ms is the baseline
    for _ in range(2):
        drafting_step(policy, accepted=0, draft_ms=8.0, verify_ms=11.0)
    assert policy.paused and policy.draft_length() == 0 and policy.pauses == 1
    for _ in range(3):
        policy.record([0], [0], 0.0, 10 * MS)
    assert not policy.paused and policy.draft_length() == 1  # a probe at the shortest length
    drafting_step(policy, accepted=0, draft_ms=8.0, verify_ms=11.0)
    assert policy.paused_for == 6  # doubled
    for _ in range(6):
        policy.record([0], [0], 0.0, 10 * MS)
    drafting_step(policy, accepted=0, draft_ms=8.0, verify_ms=11.0)
    assert policy.paused_for == 6  # capped at max_pause_steps
    assert policy.pauses == 3


def test_cheap_or_accepted_drafts_keep_drafting():
    cheap = AdaptivePolicy(max_tokens=5, warmup_steps=1)
    cheap.record([0], [0], 0.0, 10 * MS)
    for _ in range(20):
        drafting_step(cheap, accepted=1, draft_ms=0.05, verify_ms=10.5)
    assert cheap.pauses == 0 and cheap.draft_length() >= 1
    accepted = AdaptivePolicy(max_tokens=5, warmup_steps=1)
    accepted.record([0], [0], 0.0, 10 * MS)
    for _ in range(20):
        drafting_step(accepted, accepted=5, draft_ms=3.0, verify_ms=12.0)
    assert accepted.pauses == 0 and accepted.draft_length() == 5


def test_drafting_resumes_after_a_pause_once_it_pays_again():
    policy = AdaptivePolicy(max_tokens=4, warmup_steps=1, pause_steps=2)
    policy.record([0], [0], 0.0, 10 * MS)
    drafting_step(policy, accepted=0, draft_ms=3.0)
    assert policy.paused
    policy.record([0], [0], 0.0, 10 * MS)
    policy.skip_step()  # another source drafted: the pause still runs down
    assert not policy.paused
    for _ in range(8):
        drafting_step(policy, accepted=5, draft_ms=3.0)
    assert policy.pauses == 1 and not policy.paused and policy.draft_length() == 4 and policy.next_pause == 2


def test_policy_rejects_bad_options():
    with pytest.raises(ValueError, match="max_tokens"):
        AdaptivePolicy(max_tokens=0)
    with pytest.raises(ValueError, match="decay"):
        AdaptivePolicy(decay=1.0)
    with pytest.raises(ValueError, match="pause_steps"):
        AdaptivePolicy(pause_steps=8, max_pause_steps=4)
    with pytest.raises(ValueError, match="length_rule"):
        AdaptivePolicy(length_rule="fastest")


class CountingDrafter:
    """Drafts `token` k times; records the calls it gets."""

    def __init__(self, token: int = 7) -> None:
        self.token, self.proposed, self.accepted = token, [], []

    def start(self, prompts, setup):
        pass

    def propose(self, sequences, max_tokens):
        self.proposed.append(list(max_tokens))
        k = max(max_tokens)
        return Draft(tokens=torch.full((len(sequences), k), self.token), lengths=torch.tensor(max_tokens))

    def on_accept(self, num_accepted):
        self.accepted.append(num_accepted.tolist())

    def select_rows(self, rows):
        pass


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.005  # every reading 5 ms later: drafts cost 5 ms, verify steps 5 ms
        return self.now


def test_wrapper_skips_the_inner_drafter_while_paused():
    inner = CountingDrafter()
    policy = AdaptivePolicy(max_tokens=3, warmup_steps=1, pause_steps=2)
    drafter = AdaptiveDrafter(inner, policy, clock=FakeClock())
    setup = DraftSetup(do_sample=False, score_fn=None, generator=None, device=torch.device("cpu"))
    drafter.start([torch.tensor([1, 2])], setup)
    seq = [torch.tensor([1, 2, 3])]
    draft = drafter.propose(seq, [2])
    assert draft.tokens.shape == (1, 2) and inner.proposed == [[2]]  # min(policy length 3, budget 2)
    drafter.on_accept(torch.tensor([0]))
    assert inner.accepted == [[0]] and policy.paused  # 5 ms per draft token, nothing accepted: pause
    draft = drafter.propose(seq, [5])
    assert draft.tokens.shape == (1, 0) and int(draft.lengths[0]) == 0 and len(inner.proposed) == 1
    drafter.on_accept(torch.tensor([0]))
    assert len(inner.accepted) == 1  # the inner drafter saw neither call


@pytest.mark.parametrize(
    "policy", [dict(), dict(warmup_steps=1, min_gain=100.0, pause_steps=3), dict(length_rule="cost", warmup_steps=1)]
)
def test_adaptive_ngram_greedy_equals_plain_greedy(policy):
    """Greedy output does not depend on how much is drafted (min_gain=100 forces pauses)."""
    model = tiny_model()
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9, 5, 6]])
    plain = model.generate(prompt, max_new_tokens=30, do_sample=False)
    drafter = AdaptiveDrafter(NgramDrafter(5), AdaptivePolicy(max_tokens=5, **policy))
    out = speculative_generate(model, prompt, max_new_tokens=30, do_sample=False, quasar_config={"drafter": drafter})
    assert torch.equal(out, plain)
