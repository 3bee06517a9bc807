"""Stop strings checked per row on decoded text: the same rule for plain and Quasar generation."""

from __future__ import annotations

from typing import Any

import torch
from transformers import StoppingCriteria


class RowStopSequences(StoppingCriteria):
    """Stop a row once any stop string occurs in the text of its last generated tokens.

    lm-eval's rule (`MultiTokenEOSCriteria`): decode the last len(tokens(stop)) + 2 generated tokens
    and look for the string, so a stop string split across tokens is still found. Returns one flag
    per row (bool tensor [B]), for plain `generate` and for the speculative loop alike.
    """

    def __init__(self, stop: list[str], tokenizer: Any, prompt_length: int) -> None:
        self.stop = [s for s in stop if s]
        self.prompt_length = prompt_length
        self.tokenizer = tokenizer
        self.lookback = max((len(tokenizer.encode(s, add_special_tokens=False)) + 2 for s in self.stop), default=0)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if not self.stop:
            return done
        tails = input_ids[:, self.prompt_length :][:, -self.lookback :]  # [B, <= lookback]
        for row, text in enumerate(self.tokenizer.batch_decode(tails)):
            done[row] = any(s in text for s in self.stop)
        return done
