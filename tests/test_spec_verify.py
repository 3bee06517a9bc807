"""Pure-function tests of quasar_hf.speculative.verify (greedy and exact speculative sampling)."""

import pytest
import torch

from quasar_hf.speculative.verify import greedy_accept, speculative_sample_accept


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
