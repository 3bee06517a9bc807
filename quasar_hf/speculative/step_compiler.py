"""torch.compile of one model call as a step: a code object of its own, Dynamo's settings fixed in a
context of the step's own (compat.step_context), and, with precompile, its traced code kept on disk.

compiled_steps.py and warm_up.py build on it (and `quasar-hf doctor` checks it). Steps made here run in
this module's globals: Dynamo installs the globals its generated code reads here, and so does code
loaded from disk.
"""

from __future__ import annotations

import collections  # noqa: F401  (read by the steps' generated code: _call_with_own_code)
import types
from collections.abc import Callable
from typing import Any

import torch

from quasar_hf import compat


def compiled_step(
    model: torch.nn.Module, compile_config: Any, name: str = "quasar_step", precompile: bool = False, reuse_disk: bool = True
) -> Callable:
    """`torch.compile` of a call of `model` with `compile_config` (what `model.get_compiled_call` compiles),
    as a function with a code object of its own, and Dynamo's guards built on recursive dict tags.

    Dynamo keeps its compiled graphs, and counts them against `recompile_limit`, per code object: each
    compiled step made here has its own budget and frees its graphs with itself, so a caller keeping
    one step per input shape (speculative/compiled_steps.py) never meets the limit that `generate`'s
    single compiled call hits after a few batch or cache sizes. `name` names the code object (it shows
    in Dynamo's logs, and keys the on-disk entry below).

    A compiled call first checks its guards: about five per tensor the step reads, some 1,000 tensors
    (weights, packed layouts) in a SmolLM2 step, ~3 ms of it. With recursive dict tags a module whose
    traced forward reads only tensors, tuples and plain values from its own dicts (W8A8Linear, the
    norms) is checked by comparing its dicts' version tags, and its full guards run only when one of
    those dicts changed (an attribute or buffer assigned). Dynamo reads its settings when it builds
    guards, so they are fixed once, when the step is made: Dynamo keeps them in context variables, the
    step holds a copy of the context of its making with them set (`compat.step_context`), and each call runs
    in a fresh copy of that one. Neither the caller nor another thread sees them.

    `precompile=True` also turns on torch's caching precompile for this step: Dynamo loads the step's
    traced code and guards from its on-disk cache (cache_dir()/dynamo, an entry per `name`) when one is
    there, so the step runs without tracing, and `save_compile_artifacts` writes them. Guards on object
    identity (ID_MATCH, closure and dict-version guards) cannot outlive a process and are dropped from
    such a step; tensor, type and value guards stay. The returned step's `loaded_from_disk` says
    whether its code came from the cache. `reuse_disk=False` deletes that entry first, so the step is traced
    here: torch records for `save_compile_artifacts` only what this process traces or finds in its Inductor and
    autograd caches, never traced code it loads from disk. Where this torch keeps neither setting in a context
    variable, the step compiles with Dynamo's defaults."""
    call = _call_with_own_code(model, name)
    settings = compat.step_context(precompile)
    if precompile and not reuse_disk and settings is not None and compat.precompile_supported():
        discard_precompiled(call)
    if settings is None:
        return torch.compile(call, **compile_config.to_dict())
    options = compile_config.to_dict()
    if precompile and compat.precompile_supported() and options.get("mode") is None:  # torch takes a mode or options
        options["options"] = {**(options.get("options") or {}), "guard_filter_fn": _guards_a_later_process_can_check}
    hits = compat.dynamo_cache_hits()
    compiled = settings.run(torch.compile, call, **options)  # loads a cached entry, if any
    loaded = compat.dynamo_cache_hits() > hits
    if loaded:
        _skip_dynamo_names_taken_by_loaded_code()

    def step(*args: Any, **kwargs: Any) -> Any:
        return settings.copy().run(compiled, *args, **kwargs)

    step.__wrapped__ = call  # the compiled function (Dynamo's cache entries hang on its __code__)
    step.loaded_from_disk = loaded
    return step


_PROCESS_BOUND_GUARDS = ("ID_MATCH", "CLOSURE_MATCH", "WEAKREF_ALIVE", "DICT_VERSION")


def _guards_a_later_process_can_check(entries: Any) -> list[bool]:
    """Dynamo's guard filter for a precompiled step: False for guards on object identity, which torch's
    caching precompile drops anyway (with a warning per guard, hundreds a step); the rest are kept."""
    return [
        entry.guard_type not in _PROCESS_BOUND_GUARDS and not {"ID_MATCH", "DICT_VERSION"} & set(entry.derived_guard_types)
        for entry in entries
    ]


def save_compile_artifacts() -> bytes | None:
    """torch's portable bundle of this process's compile caches (`torch.compiler.save_cache_artifacts`),
    with the traced code of the steps compiled with `precompile=True` (written to Dynamo's disk cache too)."""
    settings = compat.step_context(precompile=True)
    saved = torch.compiler.save_cache_artifacts() if settings is None else settings.run(torch.compiler.save_cache_artifacts)
    return None if saved is None else saved[0]


def discard_precompiled(step: Callable) -> None:
    """Delete the on-disk traced code of a compiled step (a later step of the same name traces afresh)."""
    import shutil

    call = getattr(step, "__wrapped__", step)
    shutil.rmtree(compat.precompiled_folder(call), ignore_errors=True)


def _skip_dynamo_names_taken_by_loaded_code() -> None:
    """Loaded traced code installs the globals it reads in this module, some named by a counter of the
    process that traced it (`__builtins_dict___0`); Dynamo names the globals of a later trace here by
    this process's counter and refuses a name already taken. Move that counter past the loaded names."""
    compat.skip_dynamo_names_taken(globals())


def _call_with_own_code(module: torch.nn.Module, name: str) -> Callable:
    """`module(*args, **kwargs)` as a new function whose code object is its own (named `name`), in this
    module's globals. Dynamo's code loads a module it needs (collections, for the returned ModelOutput,
    an OrderedDict) by that module's name when this module binds it, else under a name made of its id,
    which code loaded by a later process would not find: hence the imports of collections here."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    code = call.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):  # Python >= 3.11
        code = code.replace(co_qualname=name)
    return types.FunctionType(code, call.__globals__, name, None, call.__closure__)
