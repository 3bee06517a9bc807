"""How one speculative call makes its verification rows equal to decode steps (see ops/rowstable_attention.py).

* A QUASAR_ATTENTION model (every Quasar model): verify forwards carry `quasar_rowstable=True`; the
  row-stable kernel needs nothing else, and where no kernel applies the call runs SDPA row by row.
* An SDPA model (a BF16 verifier, a Quasar model switched back to "sdpa"): for the duration of the
  call it runs QUASAR_SDPA, which is plain SDPA except on those verify forwards.
* Any other implementation (eager, flash, ...) verifies all rows in one call, with a warning:
  its rounding may differ from one-token decode steps.
A long eager call (a prompt) also carries a MaskFacts (`long_call_kwargs`), so its layers read the mask once.
The lm_head GEMM stays batched (its M-dependent rounding reaches only the logits, never the
cache: the source of the near-ties the bf16 tests allow).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from quasar_hf import compat
from quasar_hf.ops.rowstable_attention import (
    LONG_PREFILL_ROWS,
    MASK_FACTS_KWARG,
    QUASAR_ATTENTION,
    QUASAR_SDPA,
    ROWSTABLE_KWARG,
    MaskFacts,
    register_attention,
)

_ROWSTABLE_IMPLEMENTATIONS = (QUASAR_ATTENTION, QUASAR_SDPA)


@contextlib.contextmanager
def verification_attention(model: torch.nn.Module, enabled: bool = True) -> Iterator[dict]:
    """Within the block, yields the keyword arguments that make `model`'s verify forwards row-stable ({} when off)."""
    original = compat.attn_implementation(model)
    if not enabled:
        yield {}
        return
    if original == "sdpa":
        register_attention()
        model.set_attn_implementation(QUASAR_SDPA)
        try:
            yield {ROWSTABLE_KWARG: True}
        finally:
            model.set_attn_implementation(original)
        return
    if original in _ROWSTABLE_IMPLEMENTATIONS:
        yield {ROWSTABLE_KWARG: True}
        return
    warnings.warn(
        f"attn_implementation={original!r}: verification runs it on all drafted rows at once, which may round "
        f"differently from one-token decode steps, so greedy output can differ from plain generate at near-ties. "
        f"For bit-identical verification: model.set_attn_implementation('sdpa'), then quasar_hf.use_rowstable_attention(model).",
        stacklevel=4,
    )
    yield {}


def long_call_kwargs(verify_kwargs: dict, new_tokens: int) -> dict:
    """Forward keywords for an eager call of `new_tokens` tokens per row on a model that runs our attention
    (`verify_kwargs` from verification_attention): a fresh MaskFacts when the call is long enough for the prompt
    branches, so its layers share what they read from the mask; else none."""
    if ROWSTABLE_KWARG in verify_kwargs and new_tokens > LONG_PREFILL_ROWS:
        return {MASK_FACTS_KWARG: MaskFacts()}
    return {}


@contextlib.contextmanager
def rowstable_attention_for(model: torch.nn.Module) -> Iterator[None]:
    """Within the block an SDPA model runs QUASAR_ATTENTION (e.g. a BF16 verifier benchmarked like
    for like with a Quasar model); its own implementation is restored afterwards."""
    from quasar_hf.ops.rowstable_attention import use_rowstable_attention

    original = compat.attn_implementation(model)
    if original != "sdpa":
        yield
        return
    use_rowstable_attention(model)
    try:
        yield
    finally:
        model.set_attn_implementation(original)
