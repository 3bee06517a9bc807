"""StaticVerifierCache: the verifier's KV cache allocated once, for fixed-shape (compilable) steps.

A Transformers StaticCache with room for the whole generation plus one padded verify step. Each
forward writes its tokens at the current length; rejecting drafts moves that length back. The
stale slots past it are masked by the causal mask (key position <= query position) and
overwritten by the next step: no cropping, no reallocation, no concatenation. After the eager
prefill every step has one of two shapes, [1, 1] (decode) or [1, k + 1] (verify, drafts padded
to k), so a compiled step runs two graphs and never recompiles once warm.

Batch size 1 (rows of a batch advance by different counts; `RowAlignedCache` handles that).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from quasar_hf import compat

CACHE_SLOTS_STEP = 256  # cache sizes are rounded up to this: calls of similar lengths share compiled graphs


def static_cache_slots(tokens: int) -> int:
    """Slots for `tokens` tokens, rounded up to a multiple of CACHE_SLOTS_STEP (a new size is a new graph)."""
    return -(-tokens // CACHE_SLOTS_STEP) * CACHE_SLOTS_STEP


class StaticVerifierCache:
    """Preallocated KV cache + length for one row; `forward` runs `step` (compiled or not) after an eager prefill."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch_size: int,
        device: torch.device,
        max_cache_len: int,
        step: Callable | None = None,
        verify_kwargs: dict | None = None,
    ) -> None:
        if batch_size != 1:
            raise ValueError(
                f"A static KV cache (quasar={{'cache_implementation': 'static'}} or compile) runs one prompt at a time, "
                f"got a batch of {batch_size}; generate each prompt alone, or drop the static cache for batched generation."
            )
        self.model = model
        self.max_cache_len = max_cache_len
        self.step = step if step is not None else model
        self.verify_kwargs = verify_kwargs or {}
        self.cache = compat.full_attention_static_cache(model, max_cache_len)
        self.valid_len = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.length = 0  # tokens in the cache (the write position of the next step)
        self._counter = 0  # where the cache layers will write next
        self._slots = torch.arange(max_cache_len, device=device)[None]  # [1, slots]
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kwarg = compat.cache_argument_name(model)

    @property
    def batch_size(self) -> int:
        return 1

    def forward(self, tokens: torch.Tensor, token_mask: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """Write tokens [1, n] at positions length..length+n-1; fp32 logits [1, n or 1, V].

        The first call is the prompt (eager, any length; left padding is dropped: masked keys do
        not change a row-stable step's bits). Later calls go through `step`."""
        prefill = self.length == 0
        if token_mask is not None and not bool(token_mask.all()):
            tokens = tokens[:, token_mask[0].bool()]
        n = tokens.shape[1]
        if self.length + n > self.max_cache_len:
            raise RuntimeError(f"static KV cache of {self.max_cache_len} slots cannot take {n} more after {self.length}")
        positions = torch.arange(self.length, self.length + n, device=tokens.device)[None]  # [1, n]
        # [1, max_cache_len]: the written slots. Explicit, because without a mask the slots past the
        # length (stale drafts, never-written zeros) would count as keys.
        attention_mask = (self._slots < self.length + n).long()
        if self._counter != self.length:  # after a rollback: no read of the device counters (a sync)
            compat.set_static_cache_length(self.cache, self.length)
        kwargs = {"logits_to_keep": 1} if (last_only and self._takes_logits_to_keep) else {}
        if n > 1 and not prefill:  # several tokens over a cache: verification
            kwargs.update(self.verify_kwargs)
        forward = self.model if prefill else self.step
        outputs = forward(
            input_ids=tokens,
            attention_mask=attention_mask,
            position_ids=positions,
            cache_position=positions[0],
            use_cache=True,
            **{self._cache_kwarg: self.cache},
            **kwargs,
        )
        self.length += n
        self._counter = self.length  # the layers advanced their write counters by n
        self.valid_len = self.valid_len + n
        logits = outputs.logits
        return (logits[:, -1:] if last_only else logits).float()

    def keep_accepted(self, num_keep: torch.Tensor, num_appended: int) -> None:
        """Of the last `num_appended` slots keep the first num_keep[0]: the length moves back."""
        self.forget(num_appended - int(num_keep[0]))

    def drop_last_tokens(self, counts: torch.Tensor) -> None:
        """Forget the last counts[0] tokens (roll back a drafter's own tokens)."""
        self.forget(int(counts[0]))

    def forget(self, count: int) -> None:
        count = min(count, self.length)
        self.length -= count
        self.valid_len = self.valid_len - count

    def select_rows(self, rows: torch.Tensor) -> None:
        """One row: it either stays (nothing to do) or the run ends."""

    def check_holes_supported(self) -> None:
        """One row never has holes."""
