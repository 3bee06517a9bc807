"""AppendInPlaceLayer: a dynamic KV cache layer whose appends write into storage with spare room instead
of concatenating, so a decode step does not re-copy the whole cache (the same keys and values, bit for bit:
tests/test_kv_append.py). RowAlignedCache (row_aligned_cache.py) installs it in a fresh cache's full-attention
layers through `compat.append_kv_in_place`.

It subclasses Transformers' DynamicLayer (a cache layer class, whose set changes between releases): the
one Transformers internal tests/test_layering.py lets a module outside compat/ import.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class AppendInPlaceLayer(DynamicLayer):
    """DynamicLayer whose update copies the new K/V into storage [B, H, capacity, D] and keeps
    `keys`/`values` as views [B, H, :length, D] of it: the same values as concatenation, without
    re-copying the whole cache every step. The first fill returns the states themselves (what a
    concatenation onto nothing equals); later calls return the strided views."""

    spare_slots = 256  # room added when the storage grows: at least this, or a quarter more
    quasar_full_attention = True  # compat.is_full_attention_layer: a plain full-attention layer, stored with room

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._storage = self._views = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        old = self.get_seq_length()
        new = old + key_states.shape[-2]
        if not self._fits(new, key_states):
            self._grow(old, new, key_states)
        keys, values = self._storage
        keys[:, :, old:new].copy_(key_states)
        values[:, :, old:new].copy_(value_states)
        self.keys, self.values = keys[:, :, :new], values[:, :, :new]
        self._views = (self.keys, self.values)
        return (key_states, value_states) if old == 0 else (self.keys, self.values)

    def _fits(self, new: int, key_states: torch.Tensor) -> bool:
        """The storage holds these keys (nobody replaced them) and has room for `new` slots."""
        if self._storage is None or self._views is None or self._views[0] is not self.keys:
            return False
        if self._views[1] is not self.values:
            return False
        stored = self._storage[0]
        return (
            stored.shape[2] >= new
            and stored.shape[:2] == key_states.shape[:2]
            and stored.shape[3] == key_states.shape[3]
            and stored.dtype == key_states.dtype
            and stored.device == key_states.device
        )

    def _grow(self, old: int, new: int, key_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        capacity = new + max(self.spare_slots, new // 4)
        keys = key_states.new_empty(batch, heads, capacity, dim)
        values = key_states.new_empty(batch, heads, capacity, dim)
        if old:
            keys[:, :, :old].copy_(self.keys)
            values[:, :, :old].copy_(self.values)
        self._storage = (keys, values)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # slices keys/values: still views of the storage
        self._views = (self.keys, self.values)

    def reset(self) -> None:
        super().reset()
        self._storage = self._views = None
