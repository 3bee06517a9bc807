"""Transformers' KV cache internals: the layers of a dynamic cache (their keys and values, replaced or
appended in place) and of a static cache (its write position, its rows, clearing it without a new allocation).

Cache layer classes (DynamicLayer, StaticLayer and their fields: `keys`, `values`, `is_initialized`,
`cumulative_length`) change between 5.x releases; the KV-cache code of speculative/ calls these functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def cache_key_values(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values [B, H, S, D] of a filled dynamic KV cache (the tensors it holds, not copies)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def replace_cache_key_values(cache: Any, key_values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make each layer of a dynamic KV cache hold these keys and values [B, H, S, D] (rows added or removed)."""
    for layer, (keys, values) in zip(cache.layers, key_values):
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values


def is_full_attention_layer(cache_layer: Any) -> bool:
    """True for a plain full-attention dynamic KV layer (a sliding window counts slots, not tokens), or a
    layer class of ours that stores one differently and says so (`quasar_full_attention`, AppendInPlaceLayer)."""
    from transformers.cache_utils import DynamicLayer

    return type(cache_layer) is DynamicLayer or getattr(type(cache_layer), "quasar_full_attention", False) is True


def append_kv_in_place(cache: Any, layer_class: type) -> bool:
    """Make a fresh cache's full-attention layers `layer_class()`: a DynamicLayer that appends by writing
    into storage with spare room instead of concatenating (speculative/append_in_place.py). False (cache
    untouched) when it holds any other or already filled layer."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or layer.is_initialized for layer in layers):
        return False
    layers[:] = [layer_class() for _ in layers]
    return True


def full_attention_static_cache(model: nn.Module, max_cache_len: int) -> tuple[Any, bool]:
    """A StaticCache of `max_cache_len` slots for `model`, every layer a full-attention StaticLayer,
    and whether the model has sliding layers: a sliding layer writes modulo its window, after which
    rejected drafts could not be rolled back; the model's sliding mask still limits each query to
    its window (it counts slots, so it is exact only while a row's kept slots have no holes)."""
    from transformers import StaticCache, StaticLayer

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    sliding = any(layer.is_sliding for layer in cache.layers)
    if sliding:
        cache.layers[:] = [StaticLayer(max_cache_len=max_cache_len) for _ in cache.layers]
    return cache, sliding


def set_static_cache_length(cache: Any, length: int) -> None:
    """Make the next update of every StaticLayer write at slot `length` (5.x layers write at their
    `cumulative_length` counter, a tensor updated in place so that compiled steps keep its address)."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)


def static_cache_filled(cache: Any) -> bool:
    """Whether every layer of a StaticCache has allocated its tensors (they are allocated at the first write)."""
    return all(getattr(layer, "is_initialized", False) for layer in cache.layers)


@contextlib.contextmanager
def static_cache_first_rows(cache: Any, rows: int) -> Iterator[None]:
    """Within the block the StaticCache's filled layers hold only their first `rows` rows: views of the same
    storage (the batch is the outermost dimension), so a forward of `rows` rows writes those rows in place."""
    layers = [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]
    kept = [(layer.keys, layer.values) for layer in layers]
    for layer, (keys, values) in zip(layers, kept):
        layer.keys, layer.values = keys[:rows], values[:rows]
    try:
        yield
    finally:
        for layer, (keys, values) in zip(layers, kept):
            layer.keys, layer.values = keys, values


def copy_static_cache_rows(source: Any, target: Any, target_rows: int, rows: torch.Tensor, length: int) -> None:
    """Slots [0, length) of source's rows `rows` into the first len(rows) of target's `target_rows` rows, every
    layer (a target layer not allocated yet is allocated first), and target's write position to `length`."""
    for old, new in zip(source.layers, target.layers):
        if not getattr(old, "is_initialized", False):
            continue
        if not getattr(new, "is_initialized", False):
            shape = (target_rows, -1, -1, -1)
            new.lazy_initialization(old.keys[:1].expand(*shape), old.values[:1].expand(*shape))
        new.keys[: len(rows), :, :length] = old.keys[rows, :, :length]
        new.values[: len(rows), :, :length] = old.values[rows, :, :length]
    set_static_cache_length(target, length)


def static_cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each allocated layer's keys and values [rows, H, slots, D] of a StaticCache (its tensors, written in place)."""
    return [(layer.keys, layer.values) for layer in cache.layers if getattr(layer, "is_initialized", False)]


def fill_static_cache(cache: Any, rows: int, key_values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write each layer's keys and values [R, H, W, D] into the first R rows and W slots of a StaticCache of `rows`
    rows (a layer not allocated yet is allocated first) and move its write position to W."""
    for layer, (keys, values) in zip(cache.layers, key_values):
        if not getattr(layer, "is_initialized", False):
            layer.lazy_initialization(keys[:1].expand(rows, -1, -1, -1), values[:1].expand(rows, -1, -1, -1))
        layer.keys[: keys.shape[0], :, : keys.shape[2]] = keys
        layer.values[: values.shape[0], :, : values.shape[2]] = values
    set_static_cache_length(cache, key_values[0][0].shape[2] if key_values else 0)


def clear_static_cache(cache: Any, written: int) -> None:
    """Zero the first `written` slots of every filled layer of a StaticCache and move its write position to 0:
    the cache a fresh one is, without a new allocation (its tensors keep their addresses)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and written:
            layer.keys[:, :, :written].zero_()
            layer.values[:, :, :written].zero_()
    set_static_cache_length(cache, 0)
