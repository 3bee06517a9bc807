"""Compiled steps per input shape, bounded: any sequence of batch sizes and lengths keeps compiling.

A compiled step is specialized to its shapes (batch rows, cache slots, step width). Dynamo counts
the graphs of one compiled function against `recompile_limit` (8) and, with fullgraph=True, raises
once a function has seen that many shapes. Here each shape key gets a compiled function of its own
(`step_compiler.compiled_step`: its own code object, so its own budget), and shapes are bucketed so that few
keys exist:

- batch sizes round up to a power of two (1, 2, 4, 8, 16, ...); the extra rows idle in the static
  cache (each sees only its own token, its outputs are dropped);
- every call whose prompt and new tokens fit in COMPILED_SLOTS_BASE (4096) slots, or in the model's
  context when that is shorter, uses one cache size; longer ones double it. So one decode graph and
  one verify graph per batch size serve every length up to 4096 tokens: unused slots cost no
  compute (the row-stable attention kernels skip masked keys without loading them), only memory.

`warm_up.warm_up` compiles the keys a process will meet before its first request. It also names the
table's steps by `compile_cache_key` (torch, Transformers, quasar_hf and its source, the model config and dtype,
the device, the CPU and the compile config) and turns on Dynamo's on-disk cache of traced code for them (`step_compiler.compiled_step`
with precompile), so a later process with the same key loads each step instead of tracing it. A loaded
step that fails (torch's precompile is young) has its entry deleted and is compiled afresh, once.

A key (rows, slots) holds the decode step [B, 1] and a verify step [B, width + 1] per draft width in
use (one, unless calls change `num_draft_tokens`; should a key ever reach Dynamo's limit, its function
is replaced by a fresh one, which compiles the shapes it meets again, the same bits). The table
keeps the `max_shapes` most recently used keys per model and drops the oldest (its graphs are freed
with it; coming back to that shape compiles it again, with the same bits). Which key a call starts in
depends only on its shapes. When rows finish, the rows left move to a smaller batch's key if its
function has run the widths the call uses (`ready`: no compile inside a call; `shrinks` counts the
moves). A row's bits do not depend on the batch it runs in (row-stable kernels, elementwise ops), so
compiled `quasar=True` and compiled plain decoding (`num_draft_tokens=0`) of the same prompts give the
same tokens whichever keys they pass through.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import platform
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from quasar_hf import compat
from quasar_hf.ops.rowstable_attention import decide_kernels

from . import step_compiler

logger = logging.getLogger(__name__)

MAX_COMPILED_SHAPES = 32  # shape keys kept per model (each: a decode graph and a verify graph)
COMPILED_SLOTS_BASE = 4096  # the compiled cache of every call up to this many tokens; larger ones double
SLOTS_STEP = 256  # a context shorter than the base rounds up to this
TABLE_ATTR = "_quasar_compiled_steps"


def batch_bucket(batch_size: int) -> int:
    """Rows a compiled step runs for `batch_size` prompts: the next power of two."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


def compiled_cache_slots(tokens: int, context: int | None = None) -> int:
    """Cache slots of a compiled step holding `tokens` tokens: COMPILED_SLOTS_BASE (or `context`, the model's
    max_position_embeddings, rounded up to 256 when that is smaller), doubled until they hold `tokens`."""
    slots = COMPILED_SLOTS_BASE
    if context is not None and context < slots:
        slots = max(SLOTS_STEP, -(-context // SLOTS_STEP) * SLOTS_STEP)
    while slots < tokens:
        slots *= 2
    return slots


def call_cache_slots(model: torch.nn.Module, max_length: int, num_draft_tokens: int) -> int:
    """Cache slots of a compiled call (and of warm_up's steps for it) whose rows hold up to `max_length` tokens (prompt
    + new): those tokens plus one verify step padded to the draft width, rounded as `compiled_cache_slots` rounds."""
    return compiled_cache_slots(max_length + max(num_draft_tokens, 1) + 1, model_context(model))


def model_context(model: torch.nn.Module) -> int | None:
    """The model's context length (max_position_embeddings), if its config says."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


class CompiledSteps:
    """One model's compiled steps for one CompileConfig, by shape key, least recently used dropped."""

    def __init__(self, model: torch.nn.Module, compile_config: Any, max_shapes: int = MAX_COMPILED_SHAPES) -> None:
        self.model = model
        self.compile_config = compile_config
        self.max_shapes = max_shapes
        self.steps: OrderedDict[tuple, Callable] = OrderedDict()
        self.compiled_keys = 0  # keys compiled so far (a dropped key compiled again counts again)
        self.cache_key: str | None = None  # set (warm_up): steps named by it, their traced code kept on disk
        self.failed_loads = 0  # steps loaded from disk that failed and were compiled afresh
        self.idle_caches: dict[tuple, list] = {}  # key -> KV caches no call holds now (reused, not reallocated)
        self.widths_run: dict[tuple, set[int]] = {}  # key -> step widths (tokens per row) its function has run
        self.shrinks = 0  # calls moved to a smaller batch's steps when rows finished (StaticVerifierCache.select_rows)
        self.recorded: set[tuple] = set()  # keys whose step this process traced with its code kept on disk
        self._trace_here: set[tuple] = set()  # keys whose next step is traced, never loaded from disk
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def kv_cache(self, batch_rows: int, cache_slots: int, fresh: Callable[[], Any]) -> Iterator[Any]:
        """A KV cache of this shape for the length of one call (`take_cache`, given back after)."""
        cache = self.take_cache(batch_rows, cache_slots, fresh)
        try:
            yield cache
        finally:
            self.give_back_cache(batch_rows, cache_slots, cache)

    def take_cache(self, batch_rows: int, cache_slots: int, fresh: Callable[[], Any]) -> Any:
        """A KV cache of this shape that is the taker's until `give_back_cache`: one given back earlier, else `fresh()`.
        Never shared, so concurrent calls never write one cache; kept per key, so a server's calls do not allocate
        (and zero) hundreds of MB each. The taker clears what it reads (StaticVerifierCache)."""
        with self._lock:
            idle = self.idle_caches.get((batch_rows, cache_slots)) or []
            cache = idle.pop() if idle else None
        return fresh() if cache is None else cache

    def give_back_cache(self, batch_rows: int, cache_slots: int, cache: Any) -> None:
        """Keep `cache` (from `take_cache`) for the next taker of its shape; a dropped key's caches go with it."""
        key = (batch_rows, cache_slots)
        with self._lock:
            if key in self.steps:
                self.idle_caches.setdefault(key, []).append(cache)

    def step_for(self, batch_rows: int, cache_slots: int, in_call: bool = True) -> Callable:
        """The step a static cache of this shape calls: this key's compiled function, looked up at
        each call (compiled on first use, and again after the key was dropped). `in_call=False`: a compile
        here is warm_up's, not one inside a generate call (which is logged)."""
        key = (batch_rows, cache_slots)
        self._ensure(key, in_call)
        return lambda *args, **kwargs: self.call(key, *args, **kwargs)

    def trace_afresh(self, keys: list[tuple]) -> None:
        """Make the steps of `keys` that this process has not traced with their code kept on disk trace on their
        next use, their entries in torch's disk cache deleted first. A step loaded from that cache leaves torch
        nothing to record, so `step_compiler.save_compile_artifacts` would bundle without it (warm_up)."""
        with self._lock:
            for key in keys:
                if key not in self.recorded:
                    self.steps.pop(key, None)
                    self.widths_run.pop(key, None)
                    self._trace_here.add(key)

    def call(self, key: tuple, *args: Any, **kwargs: Any) -> Any:
        """Run the key's compiled function; should Dynamo refuse it one more graph, run a fresh one. A step
        whose code was loaded from disk and fails is compiled afresh, its entry deleted, and run again
        (a step writes its keys and values at fixed cache positions: running it twice writes them twice)."""
        step = self._ensure(key)
        try:
            outputs = step(*args, **kwargs)
        except compat.recompile_limit_error():
            # Raised while checking guards, before anything ran: a fresh function has an empty budget.
            outputs = self._replace(key, in_call=True)(*args, **kwargs)
        except Exception as error:
            if not getattr(step, "loaded_from_disk", False):
                raise
            logger.warning(
                "quasar_hf: the compiled step for %d rows x %d cache slots loaded from torch's cache failed "
                "(%s: %s); deleting that entry and compiling it again",
                *key,
                type(error).__name__,
                error,
            )
            step_compiler.discard_precompiled(step)
            self.failed_loads += 1
            outputs = self._replace(key)(*args, **kwargs)
        if "input_ids" in kwargs:
            self.widths_run.setdefault(key, set()).add(kwargs["input_ids"].shape[1])
        return outputs

    def _replace(self, key: tuple, in_call: bool = False) -> Callable:
        """A fresh function for `key` (it has run no width yet)."""
        self.widths_run.pop(key, None)
        self.steps[key] = step = self._compile(key, precompile=False, in_call=in_call)
        return step

    def ready(self, batch_rows: int, cache_slots: int, widths: set[int]) -> bool:
        """Whether this shape's function is kept and has run steps of every width in `widths` (compiled: calling it
        with them traces nothing)."""
        key = (batch_rows, cache_slots)
        return key in self.steps and widths <= self.widths_run.get(key, set())

    def warm_slots(self, batch_rows: int, tokens: int, widths: set[int]) -> int | None:
        """The smallest cache size of at least `tokens` slots whose step for `batch_rows` rows is `ready` (None: none).
        A row's bits do not depend on unused slots, so a larger warm cache serves it as exactly as its own size."""
        with self._lock:
            sizes = sorted({slots for rows, slots in self.steps if rows == batch_rows and slots >= tokens})
        return next((slots for slots in sizes if self.ready(batch_rows, slots, widths)), None)

    def _ensure(self, key: tuple, in_call: bool = True) -> Callable:
        step = self.steps.get(key)
        if step is not None:
            self.steps.move_to_end(key)
            return step
        while len(self.steps) >= self.max_shapes:
            dropped, _ = self.steps.popitem(last=False)
            self.idle_caches.pop(dropped, None)
            self.widths_run.pop(dropped, None)
            self.recorded.discard(dropped)
        self.steps[key] = step = self._compile(key, in_call=in_call)
        return step

    def _compile(self, key: tuple, precompile: bool = True, in_call: bool = False) -> Callable:
        for device in {p.device for p in self.model.parameters()}:
            decide_kernels(device)  # first-use checks run here, eagerly: the traced step reads their answers
        self.compiled_keys += 1
        if in_call:
            logger.info(
                "quasar_hf: compiling steps for %d rows x %d cache slots in this call (quasar_hf.warm_up compiles them "
                "before the first request)",
                *key,
            )
        tag = "" if self.cache_key is None else f"{self.cache_key[:16]}_"
        name = "quasar_step_{}b{}_s{}".format(tag, *key) + ("" if precompile else "_fresh")
        persistent = precompile and self.cache_key is not None
        trace_here = key in self._trace_here
        self._trace_here.discard(key)
        step = step_compiler.compiled_step(
            self.model, self.compile_config, name, precompile=persistent, reuse_disk=not trace_here
        )
        if persistent and not getattr(step, "loaded_from_disk", False):
            self.recorded.add(key)
        else:
            self.recorded.discard(key)
        return step


def compiled_steps_for(model: torch.nn.Module, compile_config: Any) -> CompiledSteps:
    """The model's table of compiled steps for `compile_config` (a new one when the config changed)."""
    table = model.__dict__.get(TABLE_ATTR)
    if table is None or table.compile_config != compile_config:
        table = CompiledSteps(model, compile_config)
        model.__dict__[TABLE_ATTR] = table
    return table


def compile_cache_key(model: torch.nn.Module, compile_config: Any) -> str:
    """SHA-256 of what a compiled step depends on beyond its shapes: torch's, Transformers' and quasar_hf's
    versions and quasar_hf's source (an edited or upgraded tree under the same version traces other code), the
    model config and dtype, the device, the CPU and the compile config."""
    import transformers

    from quasar_hf.detect import package_version

    parameter = next(model.parameters())
    key = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "quasar_hf": package_version(),
        "quasar_hf_source": source_digest(),
        "model": model.config.to_json_string(use_diff=False),
        "dtype": str(parameter.dtype),
        "device": str(parameter.device),
        "cpu": cpu_description(),
        "compile": json.dumps(compile_config.to_dict(), sort_keys=True, default=repr),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def source_digest(root: Path | None = None) -> str:
    """SHA-256 of quasar_hf's Python and C sources (relative paths and contents; `root`: the package folder,
    default this one): the code its traced steps run."""
    root = Path(__file__).resolve().parents[1] if root is None else Path(root)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".cpp", ".h", ".def") and p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def cpu_description() -> str:
    """The CPU a compiled kernel was built for: its model name and instruction-set flags."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = info.read().splitlines()
        fields = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip() for line in lines if ":" in line}
        return f"{fields.get('model name', '')}|{fields.get('flags', fields.get('Features', ''))}"
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"
