"""Accept/reject for speculative decoding: pure tensor functions (no model, no cache).

Shapes: B rows, k draft positions, V vocabulary. A row may draft fewer than k tokens
(`draft_lengths[b] <= k`); positions at or past its length are never accepted.
`target_*[:, i]` is the verifier's distribution for the token *after* draft position i - 1,
i.e. position 0 predicts the first draft token and position k the bonus token.
"""

from __future__ import annotations

import torch


def _draft_mask(draft_tokens: torch.Tensor, draft_lengths: torch.Tensor | None) -> torch.Tensor:
    """[B, k] bool: which draft positions hold a real draft token."""
    batch, k = draft_tokens.shape
    if draft_lengths is None:
        return torch.ones(batch, k, dtype=torch.bool, device=draft_tokens.device)
    positions = torch.arange(k, device=draft_tokens.device)
    return positions[None, :] < draft_lengths.to(draft_tokens.device)[:, None]


def _leading_true(accepted: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] number of leading True values (the accepted prefix length)."""
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def greedy_accept(
    draft_tokens: torch.Tensor, target_scores: torch.Tensor, draft_lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: keep the longest draft prefix equal to the target argmax.

    draft_tokens [B, k] long, target_scores [B, k+1, V] (processed fp32 scores),
    draft_lengths [B] or None. Returns (num_accepted [B], next_token [B]) where next_token is
    the target's argmax right after the accepted prefix (correction or bonus token).
    """
    _check_shapes(draft_tokens, target_scores)
    target_tokens = target_scores.argmax(dim=-1)  # [B, k+1]
    agrees = (draft_tokens == target_tokens[:, :-1]) & _draft_mask(draft_tokens, draft_lengths)
    num_accepted = _leading_true(agrees)  # [B]
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return num_accepted, next_token


def speculative_sample_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    draft_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling (Leviathan et al. / Chen et al.).

    draft_tokens [B, k]; draft_probs [B, k, V] (the q each draft was sampled from) or None for
    a deterministic drafter (q = one-hot at the draft token); target_probs [B, k+1, V] (p).
    Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
    the next token is sampled from normalize(max(0, p_i - q_i)); when every draft is accepted
    the bonus token is sampled from p_k. The emitted tokens are distributed exactly as p.
    Returns (num_accepted [B], next_token [B]).
    """
    _check_shapes(draft_tokens, target_probs)
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    if draft_probs is None:  # q = one-hot at the draft token: q(d) = 1
        q_draft = torch.ones_like(p_draft)
    else:
        q_all = _draft_distribution(draft_tokens, draft_probs, target_probs)  # [B, k, V]
        q_draft = q_all.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    uniform = torch.rand(batch, k, generator=generator, device=target_probs.device, dtype=target_probs.dtype)
    accepted = (uniform * q_draft < p_draft) & _draft_mask(draft_tokens, draft_lengths)  # u < p/q, q > 0
    num_accepted = _leading_true(accepted)  # [B]

    p_next = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < (k if draft_lengths is None else draft_lengths.to(num_accepted.device))
    at = num_accepted.clamp(max=max(k - 1, 0))  # [B] the rejected position (read only where rejected)
    if not k:
        residual = p_next
    elif draft_probs is None:  # max(0, p - one_hot(d)) is p with d's probability zeroed, the rest unchanged
        residual = p_next.scatter(1, draft_tokens[rows, at][:, None], 0.0)
    else:
        residual = (p_next - q_all[rows, at]).clamp(min=0)
    # p == q leaves no residual mass; a rejection then has probability 0, so p is the exact fallback.
    has_mass = residual.sum(dim=-1, keepdim=True) > 0
    next_dist = torch.where(rejected[:, None] & has_mass, residual, p_next)  # [B, V], unnormalized
    return num_accepted, sample_rows(next_dist, generator)


def sample_rows(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row [B] drawn from weights [B, V] (>= 0, any positive finite sum) with one uniform per row from
    `generator` (`sample_with_uniforms`); torch.multinomial would draw V exponentials per row."""
    uniforms = torch.rand(weights.shape[0], 1, generator=generator, device=weights.device, dtype=weights.dtype)
    return sample_with_uniforms(weights, uniforms)


def sample_with_uniforms(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The index [B] each row's uniform [B, 1] in [0, 1) chooses from weights [B, V] (>= 0, any positive finite
    sum; normalizing not needed): the first index whose running sum reaches (1 - u) of the row's sum, so only
    indices of positive weight can be chosen (the running sum rises only there)."""
    cumulative = weights.cumsum(dim=-1)  # [B, V]
    total = cumulative[:, -1:]  # [B, 1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("sampling weights must have a positive, finite sum in every row (got NaN, inf or all zeros)")
    threshold = (1 - uniforms.to(weights.dtype)) * total  # (0, total]: 1 - u is exact for u on torch.rand's grid
    index = torch.searchsorted(cumulative, threshold).squeeze(1)  # first i with cumulative[i] >= threshold
    return index.clamp(max=weights.shape[-1] - 1)


def _draft_distribution(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor) -> torch.Tensor:
    """[B, k, V] q: the given draft probabilities, or one-hot rows for a deterministic drafter."""
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        one_hot = torch.zeros(batch, k, vocab, dtype=target_probs.dtype, device=target_probs.device)
        return one_hot.scatter_(-1, draft_tokens[..., None], 1.0)
    if draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"draft_probs must have shape {(batch, k, vocab)} (B, k, V), got {tuple(draft_probs.shape)}.")
    return draft_probs.to(target_probs.dtype)


def _check_shapes(draft_tokens: torch.Tensor, target: torch.Tensor) -> None:
    if draft_tokens.dim() != 2 or target.dim() != 3:
        raise ValueError(
            f"draft_tokens must be [B, k] and target [B, k+1, V]; got {tuple(draft_tokens.shape)} and {tuple(target.shape)}."
        )
    if target.shape[:2] != (draft_tokens.shape[0], draft_tokens.shape[1] + 1):
        raise ValueError(
            f"target has shape {tuple(target.shape)} but draft_tokens {tuple(draft_tokens.shape)} needs "
            f"[{draft_tokens.shape[0]}, {draft_tokens.shape[1] + 1}, V] (one more position than drafts: the bonus token)."
        )
