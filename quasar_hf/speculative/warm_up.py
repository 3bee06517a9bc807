"""warm_up: compile every step a process will run before its first request, from a cache on disk when it can.

Compiled `quasar=...` steps are keyed by (batch rows, cache slots) (compiled_steps.py); each key runs a
decode graph [B, 1] and a verify graph [B, k + 1]. `warm_up(model, batch_sizes, max_length)` builds
the keys those calls use and runs one decode and one verify step through each, so Dynamo traces and
Inductor compiles now instead of inside a request; a progress bar shows the shapes and the time is
returned and logged.

Inductor and AOTAutograd cache what they compile on disk (torch's FX-graph and autograd caches, keyed by
the graph, the inputs and torch's version), and with a cache folder Dynamo keeps the steps' traced code
and guards there too (torch's caching precompile, per step name: compiled_steps.compile_cache_key), so a
second process neither traces nor compiles. Those caches live under /tmp; warm_up also keeps torch's
portable bundle of them (`torch.compiler.save_cache_artifacts`) per user and machine in
cache_root()/compiled, under a key of torch's, Transformers' and quasar_hf's versions, quasar_hf's source
digest, the model config and dtype, the CPU, the compile config and the shapes, and loads it before compiling. A bundle whose bytes do not
match the SHA-256 recorded beside it, or that torch cannot read or load, or whose traced code fails when run,
is deleted and rebuilt, never used. Entries torch's caches hold for other graphs are ignored by torch.

torch bundles only what this process recorded: graphs it compiled or found in its Inductor and autograd
caches, and traced code it traced, never traced code it loaded from its /tmp cache. So when a bundle must be
written (missing, rebuilt, or one that did not hold every step), the steps this process has not traced are
traced again, their entries in torch's /tmp cache deleted first: a Dynamo trace, the compiled graphs found in
torch's caches. That keeps the bundle whole without touching torch's cache folder, which is the process's
(pointing it into the bundle folder would move every other compile of the process there too).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quasar_hf import compat
from quasar_hf.atomic_folder import write_bytes_atomically
from quasar_hf.locking import cache_root

from . import step_compiler
from .compiled_steps import batch_bucket, call_cache_slots, compile_cache_key, compiled_steps_for
from .config import DEFAULT_NUM_DRAFT_TOKENS
from .static_cache import StaticCacheBuffer, StaticVerifierCache
from .verify_attention import verification_attention

logger = logging.getLogger(__name__)


@dataclass
class WarmUpReport:
    """What warm_up did: the shapes, the seconds, the graphs Dynamo built, and the on-disk bundle."""

    shapes: list[tuple[int, int]] = field(default_factory=list)  # (rows, slots)
    seconds: float = 0.0
    graphs_compiled: int = 0
    cache_file: str | None = None
    cache: str = "off"  # "off", "loaded", "missing", "rebuilt: <why>"


def warm_up(
    model: torch.nn.Module,
    batch_sizes: Iterable[int] = (1,),
    max_length: int | None = None,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    compile_config: Any = None,
    cache_folder: str | Path | None = "default",
    log: Callable[[str], None] | None = None,
    progress: bool = True,
) -> WarmUpReport:
    """Compile the decode and verify steps of every batch size in `batch_sizes` (rounded as calls round them)
    for calls of up to `max_length` tokens (prompt + new tokens; default: COMPILED_SLOTS_BASE), the same
    steps `generate(..., quasar={"compile": compile_config or True, "num_draft_tokens": num_draft_tokens})`
    then runs. `cache_folder=None` skips the on-disk bundle; "default" is locking.cache_root()/compiled."""
    started = time.perf_counter()
    device = compat.input_device(model)
    config = compile_config if compile_config not in (None, True) else compat.default_compile_config(device)
    slots = call_cache_slots(model, max_length or 1, num_draft_tokens)  # what a call of max_length tokens takes
    shapes = sorted({(batch_bucket(size), slots) for size in batch_sizes})
    report = WarmUpReport(shapes=shapes)
    bundle = _bundle_path(model, config, shapes, num_draft_tokens, cache_folder)
    if bundle is not None:
        report.cache_file, report.cache = str(bundle), load_bundle(bundle)
    graphs_before = compat.graphs_built()
    table = compiled_steps_for(model, config)
    if bundle is not None:
        table.cache_key = table.cache_key or compile_cache_key(model, config)  # steps' traced code kept on disk
    if bundle is not None and report.cache != "loaded":  # a bundle to write: every step recorded in this process
        table.trace_afresh(shapes)
    failed_loads = table.failed_loads
    run_each_step = functools.partial(_run_each_step, model, table, shapes, max(num_draft_tokens, 1), progress)
    run_each_step()
    if bundle is not None and report.cache == "loaded" and compat.graphs_built() > graphs_before:
        report.cache = "rebuilt: it did not hold every step"  # rewritten whole, not with the new steps alone
        table.trace_afresh(shapes)
        run_each_step()
    report.graphs_compiled = compat.graphs_built() - graphs_before
    if bundle is not None and table.failed_loads > failed_loads:  # its traced code failed: never loaded again
        report.cache = "rebuilt: a step loaded from it failed"
        bundle.unlink(missing_ok=True)
    if bundle is not None and report.cache != "loaded":
        save_bundle(bundle)
    report.seconds = time.perf_counter() - started
    message = (
        f"compiled steps for batch sizes {[r for r, _ in shapes]} and up to {slots} tokens in {report.seconds:.1f} s "
        f"({report.graphs_compiled} graphs traced; cache: {report.cache})"
    )
    (log or logger.info)(message)
    return report


def _run_each_step(model: torch.nn.Module, table: Any, shapes: list, width: int, progress: bool) -> None:
    """One eager prefill, one decode step [rows, 1] and one verify step [rows, width + 1] through each shape's step."""
    from tqdm.auto import tqdm

    device = compat.input_device(model)
    with torch.no_grad(), verification_attention(model, True) as verify_kwargs:
        for rows, cache_slots in tqdm(shapes, desc="Quasar compiling steps", unit="shape", disable=not progress):
            step = table.step_for(rows, cache_slots, in_call=False)
            with table.kv_cache(rows, cache_slots, lambda: StaticCacheBuffer.fresh(model, cache_slots)) as kv:  # kept for calls
                cache = StaticVerifierCache(model, rows, device, cache_slots, step, verify_kwargs, kv=kv)
                cache.forward(torch.ones(rows, 2, dtype=torch.long, device=device), last_only=True)  # the eager prefill
                cache.forward(torch.ones(rows, 1, dtype=torch.long, device=device))  # decode graph [rows, 1]
                cache.forward(torch.ones(rows, width + 1, dtype=torch.long, device=device))  # verify graph


def _bundle_path(model: torch.nn.Module, config: Any, shapes: list, width: int, folder: Any) -> Path | None:
    """cache_root()/compiled/<key>.bin for this model, machine, compile config and shapes (None: no bundle)."""
    if folder is None:
        return None
    if folder == "default":
        folder = cache_root() / "compiled"
    key = {"steps": compile_cache_key(model, config), "shapes": shapes, "draft_width": width}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return Path(folder) / f"{type(model).__name__}-{digest}.bin"


def load_bundle(path: Path) -> str:
    """Hot-load a saved bundle into torch's compile caches: "loaded", "missing", or "rebuilt: <why>" (deleted)."""
    record = path.with_suffix(".json")
    if not path.is_file() or not record.is_file():
        return "missing"
    try:
        data = path.read_bytes()
        expected = json.loads(record.read_text()).get("sha256")
        if hashlib.sha256(data).hexdigest() != expected:
            raise ValueError("its bytes do not match the SHA-256 recorded beside it")
        if torch.compiler.load_cache_artifacts(data) is None:  # torch logged why; it loaded nothing
            raise ValueError("torch could not read it")
        return "loaded"
    except Exception as error:  # a damaged or foreign bundle: never used, rebuilt by this warm-up
        path.unlink(missing_ok=True)
        record.unlink(missing_ok=True)
        reason = f"rebuilt: {path.name} could not be used ({type(error).__name__}: {error})"
        logger.warning("quasar_hf: %s", reason)
        return reason


def save_bundle(path: Path) -> None:
    """Write torch's bundle of this process's compile artifacts, and its SHA-256 beside it (atomically)."""
    try:
        data = step_compiler.save_compile_artifacts()  # also writes the steps' traced code to torch's cache
    except Exception as error:  # torch could not gather or write them: the steps are compiled, the next process compiles again
        logger.warning("quasar_hf: torch could not save the compiled steps (%s: %s)", type(error).__name__, error)
        return
    if data is None:  # the steps are compiled; the next process compiles them again
        logger.warning("quasar_hf: torch recorded no compiled steps to save; %s was not written", path)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(path, data)
        record = {"sha256": hashlib.sha256(data).hexdigest(), "torch": torch.__version__, "bytes": len(data)}
        write_bytes_atomically(path.with_suffix(".json"), json.dumps(record).encode())
    except OSError as error:  # a read-only cache: the steps are compiled, the next process compiles again
        logger.warning("quasar_hf: could not save the compiled steps to %s: %s", path, error)
