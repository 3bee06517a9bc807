"""torch.compile's settings for quasar's compiled steps: the CompileConfig they compile with, and
Dynamo's settings (recursive dict tags for guards, caching precompile) fixed in a context of their own.

Dynamo keeps these settings in `torch._dynamo.config`, private, and kept in context variables or not
depending on the torch release; the rest of the package calls these functions instead.
"""

from __future__ import annotations

import contextvars
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
