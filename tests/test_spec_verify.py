"""Pure-function tests of quasar_hf.speculative.verify (greedy and exact speculative sampling)."""

import pytest
import torch

from quasar_hf.speculative.verify import greedy_accept, sample_rows, speculative_sample_accept
from tests.helpers.sampling_stats import chi_square_p_value


def one_hot_scores(tokens, vocab=8):
    """[B, n] target argmax tokens -> [B, n, V] scores whose argmax is those tokens."""
    scores = torch.zeros(*tokens.shape, vocab)
    return scores.scatter_(-1, tokens[..., None], 5.0)


def test_greedy_accepts_longest_agreeing_prefix_and_returns_the_target_next_token():
    target = torch.tensor([[1, 2, 3, 4], [1, 5, 3, 4], [6, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    num, nxt = greedy_accept(drafts, one_hot_scores(target))
    assert num.tolist() == [3, 1, 0]
    assert nxt.tolist() == [4, 5, 6]  # bonus token when all accepted, else the correction


def test_greedy_respects_draft_lengths_and_zero_drafts():
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 0]])
    num, nxt = greedy_accept(drafts, one_hot_scores(target), torch.tensor([1, 2]))
    assert num.tolist() == [1, 2] and nxt.tolist() == [2, 3]
    num, nxt = greedy_accept(torch.zeros(2, 0, dtype=torch.long), one_hot_scores(target[:, :1]))
    assert num.tolist() == [0, 0] and nxt.tolist() == [1, 1]


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="one more position"):
        greedy_accept(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        speculative_sample_accept(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, 7), torch.full((1, 3, 8), 1 / 8))


def test_sampling_accepts_draft_with_probability_one_when_p_is_at_least_q():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])  # [1, 3, 3]
    drafts = torch.tensor([[1, 2]])
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        num, nxt = speculative_sample_accept(drafts, None, p, gen)
        assert num.item() == 2 and nxt.item() == 0  # bonus drawn from p[:, 2]


def test_sampling_never_accepts_a_zero_probability_draft_and_excludes_it_from_the_residual():
    p = torch.tensor([[[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]]])  # draft token 1 has p = 0
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        num, nxt = speculative_sample_accept(torch.tensor([[1]]), None, p, gen)
        assert num.item() == 0 and nxt.item() in (0, 2)


def test_sampling_residual_is_p_minus_q_renormalised():
    # p = [0.6, 0.4], q = [0.0, 1.0] (draft token 1): accept w.p. 0.4; on rejection residual = [1, 0].
    p = torch.tensor([[[0.6, 0.4], [0.5, 0.5]]]).expand(20000, 2, 2).contiguous()
    q = torch.tensor([[[0.0, 1.0]]]).expand(20000, 1, 2).contiguous()
    drafts = torch.ones(20000, 1, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    num, nxt = speculative_sample_accept(drafts, q, p, gen)
    first = torch.where(num == 1, drafts[:, 0], nxt)  # the first emitted token
    assert abs(num.float().mean().item() - 0.4) < 0.02
    assert torch.all(nxt[num == 0] == 0)  # residual has all its mass on token 0
    assert abs((first == 0).float().mean().item() - 0.6) < 0.02  # first token ~ p


def test_sampling_with_identical_p_and_q_always_accepts():
    probs = torch.softmax(torch.randn(64, 3, 10, generator=torch.Generator().manual_seed(1)), -1)
    drafts = torch.multinomial(probs[:, :2].reshape(-1, 10), 1).view(64, 2)
    num, _ = speculative_sample_accept(drafts, probs[:, :2], probs, torch.Generator().manual_seed(2))
    assert torch.all(num == 2)


def test_sampling_respects_draft_lengths():
    p = torch.tensor([[[0.0, 1.0], [0.0, 1.0], [1.0, 0.0]]]).expand(2, 3, 2).contiguous()
    drafts = torch.tensor([[1, 1], [1, 1]])
    num, nxt = speculative_sample_accept(drafts, None, p, torch.Generator().manual_seed(0), torch.tensor([0, 1]))
    assert num.tolist() == [0, 1] and nxt.tolist() == [1, 1]


def test_sample_rows_draws_each_row_from_its_weights_and_never_a_zero_weight():
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0, 6.0]])  # unnormalized
    draws = sample_rows(weights.repeat(20000, 1), torch.Generator().manual_seed(0)).view(20000, 2)
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=6)
        assert torch.all(counts[weights[row] == 0] == 0)
        assert chi_square_p_value(counts, weights[row] / weights[row].sum()) > 1e-3
    wrong = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0, 0.0])  # the test tells a wrong distribution apart
    assert chi_square_p_value(torch.bincount(draws[:, 0], minlength=6), wrong) < 1e-8


def test_sample_rows_takes_one_uniform_per_row_and_refuses_weights_without_mass():
    generator, twin = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    sample_rows(torch.rand(3, 1000), generator)
    torch.rand(3, 1, generator=twin)
    assert torch.equal(torch.rand(4, generator=generator), torch.rand(4, generator=twin))
    assert sample_rows(torch.tensor([[0.0, 0.0, 1e-30]])).item() == 2  # the one index with weight, however small
    for bad in (torch.zeros(1, 4), torch.tensor([[0.5, float("nan")]]), torch.tensor([[float("inf"), 1.0]])):
        with pytest.raises(ValueError, match="positive, finite sum"):
            sample_rows(bad)


def test_deterministic_draft_residual_is_p_without_the_rejected_token():
    # p = [0.2, 0.5, 0.3] at the draft position, draft token 1: rejected w.p. 0.5, then 0 or 2 in ratio 2:3.
    p = torch.tensor([[[0.2, 0.5, 0.3], [1.0, 0.0, 0.0]]]).expand(20000, 2, 3).contiguous()
    num, nxt = speculative_sample_accept(torch.ones(20000, 1, dtype=torch.long), None, p, torch.Generator().manual_seed(1))
    counts = torch.bincount(nxt[num == 0], minlength=3)
    assert counts[1] == 0 and chi_square_p_value(counts, torch.tensor([0.4, 0.0, 0.6])) > 1e-3
    assert abs(num.float().mean().item() - 0.5) < 0.02
