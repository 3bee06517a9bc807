"""Where a long-lived static batch (the serving engine's rows) takes the step and KV cache of each batch size
(static_cache.BufferSource).

A `generate` call holds its static cache for the call (`CompiledSteps.kv_cache`). The engine's batch outlives
calls and changes size as rows join and leave, so its StaticVerifierCache takes a cache for the batch size it
moves to and gives the old one back itself. Batch sizes are compiled_steps.batch_bucket's powers of two, so a
batch that grows or shrinks moves between the warm shapes `warm_up` compiled and never traces a new graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .compiled_steps import CompiledSteps
from .static_cache import StaticCacheBuffer  # the BufferSource protocol these implement is static_cache's


class FreshBuffers:
    """Uncompiled steps (the model itself) and a new cache per take (`cache_implementation="static"` alone)."""

    def __init__(self, model: torch.nn.Module, slots: int) -> None:
        self.model = model
        self.slots = slots

    def take(self, rows: int) -> tuple[Callable, StaticCacheBuffer]:
        return self.model, StaticCacheBuffer.fresh(self.model, self.slots)

    def give_back(self, rows: int, kv: StaticCacheBuffer) -> None:
        """Nothing to keep: the cache is freed with its last reference."""

    def ready(self, rows: int) -> bool:
        return True


class CompiledBuffers:
    """A CompiledSteps table's step and kept caches per batch size; `widths`: the step widths the batch runs
    (decode 1, verify k + 1), all of which a size's step must have run to be `ready`."""

    def __init__(self, model: torch.nn.Module, table: CompiledSteps, slots: int, widths: set[int]) -> None:
        self.model = model
        self.table = table
        self.slots = slots
        self.widths = widths

    def take(self, rows: int) -> tuple[Callable, StaticCacheBuffer]:
        kv = self.table.take_cache(rows, self.slots, lambda: StaticCacheBuffer.fresh(self.model, self.slots))
        return self.table.step_for(rows, self.slots), kv

    def give_back(self, rows: int, kv: StaticCacheBuffer) -> None:
        self.table.give_back_cache(rows, self.slots, kv)

    def ready(self, rows: int) -> bool:
        return self.table.ready(rows, self.slots, self.widths)
