"""Compiled steps per input shape, bounded: any sequence of batch sizes and lengths keeps compiling.

A compiled step is specialized to its shapes (batch rows, cache slots, step width). Dynamo counts
the graphs of one compiled function against `recompile_limit` (8) and, with fullgraph=True, raises
once a function has seen that many shapes. Here each shape key gets a compiled function of its own
(`compat.compiled_step`: its own code object, so its own budget), and shapes are bucketed so that few
keys exist:

- batch sizes round up to a power of two (1, 2, 4, 8, 16, ...); the extra rows idle in the static
  cache (each sees only its own token, its outputs are dropped);
- cache sizes round up to 256 slots times a power of two (256, 512, 1024, ...).

A key (rows, slots) holds the decode step [B, 1] and a verify step [B, width + 1] per draft width in
use (one, unless calls change `num_draft_tokens`; should a key ever reach Dynamo's limit, its function
is replaced by a fresh one, which compiles the shapes it meets again, the same bits). The table
keeps the `max_shapes` most recently used keys per model and drops the oldest (its graphs are freed
with it; coming back to that shape compiles it again, with the same bits). Which key a call uses
depends only on its shapes, so compiled `quasar=True` and compiled plain decoding
(`num_draft_tokens=0`) of the same prompts run the same graphs, whatever ran before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from quasar_hf import compat
from quasar_hf.ops.rowstable_attention import decide_kernels

MAX_COMPILED_SHAPES = 32  # shape keys kept per model (each: a decode graph and a verify graph)
COMPILED_SLOTS_BASE = 256  # the smallest compiled cache; larger ones double
TABLE_ATTR = "_quasar_compiled_steps"


def batch_bucket(batch_size: int) -> int:
    """Rows a compiled step runs for `batch_size` prompts: the next power of two."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


def compiled_cache_slots(tokens: int) -> int:
    """Cache slots of a compiled step holding `tokens` tokens: 256 times a power of two."""
    slots = COMPILED_SLOTS_BASE
    while slots < tokens:
        slots *= 2
    return slots


class CompiledSteps:
    """One model's compiled steps for one CompileConfig, by shape key, least recently used dropped."""

    def __init__(self, model: torch.nn.Module, compile_config: Any, max_shapes: int = MAX_COMPILED_SHAPES) -> None:
        self.model = model
        self.compile_config = compile_config
        self.max_shapes = max_shapes
        self.steps: OrderedDict[tuple, Callable] = OrderedDict()
        self.compiled_keys = 0  # keys compiled so far (a dropped key compiled again counts again)

    def step_for(self, batch_rows: int, cache_slots: int) -> Callable:
        """The step a static cache of this shape calls: this key's compiled function, looked up at
        each call (compiled on first use, and again after the key was dropped)."""
        key = (batch_rows, cache_slots)
        self._ensure(key)
        return lambda *args, **kwargs: self.call(key, *args, **kwargs)

    def call(self, key: tuple, *args: Any, **kwargs: Any) -> Any:
        """Run the key's compiled function; should Dynamo refuse it one more graph, run a fresh one."""
        step = self._ensure(key)
        try:
            return step(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            # Raised while checking guards, before anything ran: a fresh function has an empty budget.
            self.steps[key] = step = self._compile(key)
            return step(*args, **kwargs)

    def _ensure(self, key: tuple) -> Callable:
        step = self.steps.get(key)
        if step is not None:
            self.steps.move_to_end(key)
            return step
        while len(self.steps) >= self.max_shapes:
            self.steps.popitem(last=False)
        self.steps[key] = step = self._compile(key)
        return step

    def _compile(self, key: tuple) -> Callable:
        for device in {p.device for p in self.model.parameters()}:
            decide_kernels(device)  # first-use checks run here, eagerly: the traced step reads their answers
        self.compiled_keys += 1
        name = "quasar_step_b{}_s{}".format(*key)
        return compat.compiled_step(self.model, self.compile_config, name)


def compiled_steps_for(model: torch.nn.Module, compile_config: Any) -> CompiledSteps:
    """The model's table of compiled steps for `compile_config` (a new one when the config changed)."""
    table = model.__dict__.get(TABLE_ATTR)
    if table is None or table.compile_config != compile_config:
        table = CompiledSteps(model, compile_config)
        model.__dict__[TABLE_ATTR] = table
    return table
