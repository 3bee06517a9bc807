"""torch.compile's settings for quasar's compiled steps: the CompileConfig they compile with, and
Dynamo's settings (recursive dict tags for guards, caching precompile) fixed in a context of their own;
and what the steps read of Dynamo's internals: its counters (cache hits, graphs built), the error of
a hit recompile limit, the on-disk folder of a step's traced code, its counter of generated names.

Dynamo keeps these settings in `torch._dynamo.config`, private, and kept in context variables or not
depending on the torch release, and its counters, errors and disk cache under torch._dynamo.utils,
.exc and .package; the rest of the package calls these functions instead.
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch


def default_compile_config(device: torch.device) -> Any:
    """The CompileConfig of a compiled step: one full graph per static shape; CUDA graphs on CUDA
    (mode "reduce-overhead"'s option), Inductor's C++ code elsewhere (the CPU opt-in that generate checks).
    `emulate_precision_casts` keeps the bf16 rounding after each op that eager has: without it Inductor
    keeps fused intermediates in fp32, and SmolLM2's compiled verify rows then differ from its compiled
    decode steps (benchmarks/reports/compiled-rows/compiled_rows_smollm2_cpu.md). `size_asserts` off drops the size and
    stride check Inductor runs on every graph input and op output at every call (~1,300 per SmolLM2
    step): Dynamo's guards already check the inputs, and our ops' fake implementations are tested
    against the real ones (opcheck in tests/test_ops_torch_ops.py). What `quasar={"compile": True}`
    compiles with: no graph pass, the modules already call the fused ops."""
    from transformers import CompileConfig

    cuda = torch.device(device).type == "cuda"
    options = {"emulate_precision_casts": True, "size_asserts": False}
    if cuda:
        options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets (torch takes a mode or options)
    config = CompileConfig(fullgraph=True, dynamic=False, mode=None, options=options)
    config._compile_all_devices = not cuda  # generate compiles CPU steps only when asked to
    return config


def step_context(precompile: bool = False) -> contextvars.Context | None:
    """A copy of the current context in which Dynamo builds guards on recursive dict tags (and, with
    `precompile` where this torch has it, caches traced code on disk), or None where Dynamo does not
    keep those settings in context variables (a value set inside a copy would leak)."""
    entries = getattr(torch._dynamo.config, "_config", {})
    names = ["use_recursive_dict_tags_for_guards"] + (["caching_precompile"] if precompile_supported() and precompile else [])
    if not all(isinstance(getattr(entries.get(n), "user_override", None), contextvars.ContextVar) for n in names):
        return None
    context = contextvars.copy_context()
    context.run(_enable_step_settings, "caching_precompile" in names)
    return context


def _enable_step_settings(precompile: bool) -> None:
    """Run inside `step_context`'s private copy only."""
    torch._dynamo.config.use_recursive_dict_tags_for_guards = True
    if precompile:
        torch._dynamo.config.caching_precompile = True


def precompile_supported() -> bool:
    """Whether this torch can keep Dynamo's traced code on disk (torch._dynamo.config.caching_precompile)."""
    entry = getattr(torch._dynamo.config, "_config", {}).get("caching_precompile")
    return isinstance(getattr(entry, "user_override", None), contextvars.ContextVar)


def dynamo_cache_hits() -> int:
    """How many times Dynamo has loaded traced code from its on-disk cache in this process (caching precompile)."""
    return torch._dynamo.utils.counters["dynamo_cache"]["dynamo_cache_hit"]


def graphs_built() -> int:
    """How many graphs Dynamo has built in this process (its `unique_graphs` counter)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def recompile_limit_error() -> type[Exception]:
    """What a compiled function raises when Dynamo refuses it one more graph (it hit its recompile limit):
    raised while checking guards, before anything ran."""
    return torch._dynamo.exc.FailOnRecompileLimitHit


def precompiled_folder(function: Callable) -> str:
    """The folder of Dynamo's on-disk cache (cache_dir()/dynamo) that holds `function`'s traced code."""
    from torch._dynamo.package import CompilePackage, DynamoCache

    return f"{DynamoCache.path_prefix()}/{CompilePackage.source_id_from_fn(function)}"


def skip_dynamo_names_taken(global_names: Iterable[str]) -> None:
    """Move Dynamo's counter of generated global names past those in `global_names` (a module's globals).
    Traced code loaded from disk installs the globals it reads in the module of its function, some named by
    a counter of the process that traced it (`__builtins_dict___0`); Dynamo names the globals of a later
    trace there by this process's counter and refuses a name already taken."""
    from torch._dynamo.bytecode_transformation import unique_id

    counted = r"__(?:builtins_dict__|warnings_warn_wrapper|gen_rand_values)_(\d+)"  # Dynamo's install_global names
    taken = [int(match.group(1)) for key in global_names if (match := re.fullmatch(counted, key))]
    while taken and int(unique_id("quasar").rsplit("_", 1)[1]) < max(taken):
        pass
