"""The uniform that chooses each token of a sampled row, by the token's index in the row's output.

A sampled row of the serving engine draws from its own generator. Drawn in fixed blocks and handed out by token
index, the n-th token's uniform is the same whatever was drafted, verified or rejected before it. Each token is
then the inverse-CDF draw of that uniform from the row's distribution at that position, so a draft token is
accepted exactly when it is the token that uniform chooses: for a deterministic draft (q one-hot) this accepts
with probability p(draft) and, on rejection, draws from p without the draft token, as speculative sampling does,
and the row's text is the same with any drafts, any draft length and beside any other rows.
"""

from __future__ import annotations

import torch

from .verify import sample_with_uniforms


class TokenUniforms:
    """One sampled row's uniforms by token index, drawn from its generator `block` at a time."""

    def __init__(self, generator: torch.Generator | None, block: int = 64) -> None:
        self.generator = generator
        self.block = block
        self.values: list[float] = []  # uniforms of tokens used .. used + len - 1
        self.used = 0  # tokens chosen so far

    def peek(self, count: int) -> list[float]:
        """The uniforms of the next `count` tokens (not consumed)."""
        while len(self.values) < count:
            device = self.generator.device if self.generator is not None else "cpu"
            self.values += torch.rand(self.block, generator=self.generator, device=device).tolist()
        return self.values[:count]

    def advance(self, count: int) -> None:
        """`count` tokens were chosen."""
        self.peek(count)
        del self.values[:count]
        self.used += count


def choose_token(scores: torch.Tensor, uniform: float) -> int:
    """The token that `uniform` chooses from processed scores [V] (softmax, then inverse CDF)."""
    probs = torch.softmax(scores, dim=-1)[None]  # [1, V]
    return int(sample_with_uniforms(probs, torch.tensor([[uniform]], dtype=probs.dtype, device=probs.device))[0])


def accept_by_uniforms(uniforms: TokenUniforms, tokens: list[int], scores: torch.Tensor) -> tuple[int, int]:
    """(accepted drafts, next token) of one row: its draft `tokens` (its own length) against its processed scores
    [len(tokens) + 1, V]; the row's uniforms advance past the tokens it emits."""
    values = uniforms.peek(len(tokens) + 1)
    position = 0
    while True:
        chosen = choose_token(scores[position], values[position])
        if position == len(tokens) or chosen != tokens[position]:
            break
        position += 1
    uniforms.advance(position + 1)
    return position, chosen
