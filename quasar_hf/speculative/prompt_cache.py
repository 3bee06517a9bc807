"""PromptCache: the KV of finished requests in host memory, so a request that starts with tokens already
computed (a chat's history, a shared system prompt, an agent's growing transcript) prefills only the rest.

Entries are token sequences with each layer's keys and values [1, H, T, D] for those tokens, kept in
least-recently-used order within a byte budget. `longest_prefix` finds the entry sharing the longest token
prefix with a new prompt and returns that many tokens' keys and values; the decoding loop continues from
them exactly as `generate(past_key_values=...)` continues from an earlier turn's cache. The prompt's last
token is always prefilled, since its logits choose the first new token.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

KeyValues = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, H, T, D]


@dataclass
class PrefixHit:
    """`tokens` prompt tokens whose keys and values are `layers` (views of the cached entry)."""

    tokens: int
    layers: KeyValues


class PromptCache:
    """An LRU pool of (tokens, keys and values) within `max_bytes` (not thread-safe: the decoding worker owns it)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[int, ...], tuple[KeyValues, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def longest_prefix(self, prompt: list[int], min_tokens: int = 1) -> PrefixHit | None:
        """The cached keys and values of the longest prefix of `prompt[:-1]` that an entry shares (at least
        `min_tokens`), the entry marked as recently used; None when no entry shares that much."""
        best, best_key = 0, None
        for key in self._entries:
            shared = _shared_prefix(key, prompt, len(prompt) - 1)
            if shared > best:
                best, best_key = shared, key
        if best_key is None or best < min_tokens:
            return None
        self._entries.move_to_end(best_key)
        layers = self._entries[best_key][0]
        return PrefixHit(best, [(k[:, :, :best], v[:, :, :best]) for k, v in layers])

    def store(self, tokens: list[int], layers: KeyValues) -> None:
        """Keep `tokens`' keys and values (copied to their own storage); entries it extends are dropped, and
        the least recently used ones leave until the pool fits its budget."""
        length = len(tokens)
        if length == 0 or any(k.shape[-2] < length or v.shape[-2] < length for k, v in layers):
            raise ValueError(f"the keys and values must cover the {length} tokens stored")
        size = sum(2 * k[:, :, :length].numel() * k.element_size() for k, _ in layers)
        if size > self.max_bytes:
            return
        key = tuple(tokens)
        for old in [old for old in self._entries if _shared_prefix(old, tokens, len(old)) == len(old)]:
            self._drop(old)  # a prefix of the new entry (the same conversation, one turn earlier)
        if any(_shared_prefix(old, tokens, length) == length for old in self._entries):
            return  # an entry already extends these tokens
        copies = [(k[:, :, :length].clone(), v[:, :, :length].clone()) for k, v in layers]
        self._entries[key] = (copies, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        _, size = self._entries.pop(key)
        self.bytes -= size


def _shared_prefix(cached: tuple[int, ...], tokens: list[int], limit: int) -> int:
    """How many leading tokens `cached` and `tokens` share, at most `limit`."""
    limit = min(limit, len(cached), len(tokens))
    for index in range(limit):
        if cached[index] != tokens[index]:
            return index
    return limit
