"""Attention that makes verification rows bit-identical to decode steps (the one shape-dependent op).

Why: torch's SDPA with q_len = k+1 takes another code path than decode's q_len = 1, so its outputs
differ in the last bits. In a W8A8 model such a difference can flip the INT8 rounding of a
per-token activation, and the flipped K/V of one position then shifts every later logit
(measured on SmolLM2-135M W8A8: up to 2 logits in bf16). The INT8 GEMMs (per-token scales, exact
int32 accumulation), norms, rotary and MLP are row-independent already.

Two ways to close the gap, chosen per model:
* `QUASAR_ATTENTION` ("quasar_rowstable", installed on Quasar models by the quantizer, or on any
  model with `use_rowstable_attention`): every decode and verify call runs a kernel that computes
  each query row alone (`ops.attention_cpu` on CPU in float32/bfloat16, `ops.triton_attention`
  on CUDA), so a verified row equals its decode step by construction, at the cost of one batched
  call. Elsewhere (CPU float16, prefill of long prompts, a device where the kernel fails its
  first-use check) it is plain SDPA.
* Row-wise verification (`rowwise_verification`, for SDPA where the kernel does not apply): a
  multi-token forward over a cache runs SDPA once per query row, on exactly the keys that a
  decode step would see. Exact, but each extra SDPA call costs ~0.2 ms on CPU.
The lm_head GEMM stays batched (its M-dependent rounding reaches only the logits, never the
cache: the source of the near-ties the bf16 tests allow).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from quasar_hf.ops import attention_cpu

QUASAR_ATTENTION = "quasar_rowstable"
ROWWISE_SDPA = "quasar_rowwise_sdpa"
ROWWISE_QUASAR = "quasar_rowwise_rowstable"
# A fresh prefill longer than this goes to SDPA (multi-threaded, flash-style): it is the same call
# in plain and speculative generation, so it needs no row stability, only speed.
LONG_PREFILL_ROWS = 64
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


def _visible_keys(attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor):
    """bool [B, Q, N] from SDPA's mask [B, 1, Q, >=N] (None stays None: bottom-right causal); False if unusable."""
    if attention_mask is None:
        return None
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return False
    if attention_mask.shape[2] != q_len or attention_mask.shape[3] < kv_len:
        return False
    return attention_mask[:, 0, :, :kv_len].expand(batch, q_len, kv_len)


def rowstable_kernel_for(query, key, value):
    """The row-stable kernel for these tensors: C on CPU, Triton on CUDA, None where neither applies."""
    if query.device.type == "cpu":
        return attention_cpu.rowstable_attention if attention_cpu.supports(query, key, value) else None
    if query.device.type == "cuda":
        try:
            from quasar_hf.ops import triton_attention
        except ImportError:
            return None
        return triton_attention.rowstable_attention_triton if triton_attention.supports(query, key, value) else None
    return None


def _kernel_inputs(module, query, key, value, attention_mask, dropout, kwargs):
    """(kernel, visible) when a row-stable kernel computes this call; (None, None) otherwise."""
    if dropout or not getattr(module, "is_causal", True) or any(kwargs.get(k) is not None for k in _UNSUPPORTED_KWARGS):
        return None, None
    kernel = rowstable_kernel_for(query, key, value)
    visible = _visible_keys(attention_mask, query, key) if kernel is not None else False
    if visible is not False:
        visible = _within_sliding_window(visible, query, key, kwargs.get("sliding_window"))
    return (None, None) if visible is False else (kernel, visible)


# --- sliding windows (Gemma 3, Mistral-style) -------------------------------------------------
def _within_sliding_window(visible, query: torch.Tensor, key: torch.Tensor, window: int | None):
    """`visible` [B, Q, N] (or None: bottom-right causal) limited to the last `window` keys of each row.

    Transformers' sliding masks already say this (key j visible from row position p iff
    p - window < j <= p); applying the band again is a no-op for them and keeps a call that
    arrives without a mask from attending past the window. Rows are bottom-right aligned
    (row i sits at key index N - Q + i), as in a cache without holes.
    """
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if not window or kv_len <= window:
        return visible
    rows = torch.arange(kv_len - q_len, kv_len, device=key.device)[:, None]  # [Q, 1] key index of each row
    cols = torch.arange(kv_len, device=key.device)[None, :]  # [1, N]
    band = (cols <= rows) & (cols > rows - window)  # [Q, N]
    return band.expand(batch, q_len, kv_len) if visible is None else visible & band


def rowstable_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """AttentionInterface function: the row-stable kernel where it applies, else SDPA."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if not (q_len == kv_len and q_len > LONG_PREFILL_ROWS):
        kernel, visible = _kernel_inputs(module, query, key, value, attention_mask, dropout, kwargs)
        if kernel is not None:
            return kernel(query, key, value, visible, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def rowwise_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA with query [B, H, q, D] split into q one-row calls when verifying over a cache."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or q_len == kv_len:  # decode step or prefill: exactly plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for i in range(q_len):
        visible = kv_len - q_len + 1 + i  # keys a decode step at this position would see
        row_mask = None if attention_mask is None else attention_mask[:, :, i : i + 1, :visible]
        if row_mask is not None and row_mask.dtype == torch.bool and bool(row_mask.all()):
            row_mask = None  # plain decode drops an all-visible mask too
        out, _ = sdpa_attention_forward(
            module, query[:, :, i : i + 1], key[:, :, :visible], value[:, :, :visible], row_mask, **kwargs
        )
        outputs.append(out)  # [B, 1, H, D]
    return torch.cat(outputs, dim=1), None


def rowwise_rowstable_attention(module, query, key, value, attention_mask, **kwargs):
    """Verification for a QUASAR_ATTENTION model: the kernel where it applies (already row-stable),
    else what its decode steps ran (SDPA), one row at a time."""
    kernel, visible = _kernel_inputs(module, query, key, value, attention_mask, kwargs.get("dropout", 0.0), kwargs)
    if kernel is not None and query.shape[2] != key.shape[2]:
        return kernel(query, key, value, visible, kwargs.get("scaling")), None
    if query.shape[2] == key.shape[2]:  # a prefill: exactly what the model itself runs
        return rowstable_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return rowwise_sdpa_attention(module, query, key, value, attention_mask, **kwargs)


_FUNCTIONS = {
    QUASAR_ATTENTION: rowstable_attention_forward,
    ROWWISE_SDPA: rowwise_sdpa_attention,
    ROWWISE_QUASAR: rowwise_rowstable_attention,
}
_ROWWISE_FOR = {"sdpa": ROWWISE_SDPA, QUASAR_ATTENTION: ROWWISE_QUASAR}


def register_attention() -> None:
    """Register our attention functions and their mask builder (SDPA's) with Transformers; idempotent."""
    for name, function in _FUNCTIONS.items():
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, function)
        if name not in AttentionMaskInterface._global_mapping:
            AttentionMaskInterface.register(name, sdpa_mask)


def use_rowstable_attention(model: torch.nn.Module) -> bool:
    """Switch an SDPA model to QUASAR_ATTENTION (decode and verification rows bit-identical on CPU).

    Returns True if switched. Models on another attention implementation (eager, flash, ...) are
    left alone: the user chose it, and row-wise verification or none applies to them.
    """
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", QUASAR_ATTENTION):
        return False
    register_attention()
    model.set_attn_implementation(QUASAR_ATTENTION)
    return model.config._attn_implementation == QUASAR_ATTENTION


@contextlib.contextmanager
def rowwise_verification(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, an SDPA or QUASAR_ATTENTION model verifies with rows equal to decode steps."""
    config = model.config
    original = config._attn_implementation
    if enabled and original not in _ROWWISE_FOR:
        warnings.warn(
            f"attn_implementation={original!r}: verification runs it on all drafted rows at once, which may round "
            f"differently from one-token decode steps, so greedy output can differ from plain generate at near-ties. "
            f"For bit-identical verification: model.set_attn_implementation('sdpa'), then quasar_hf.use_rowstable_attention(model).",
            stacklevel=3,
        )
    if not enabled or original not in _ROWWISE_FOR:
        yield
        return
    register_attention()
    config._attn_implementation = _ROWWISE_FOR[original]
    try:
        yield
    finally:
        config._attn_implementation = original


@contextlib.contextmanager
def rowstable_attention_for(model: torch.nn.Module) -> Iterator[None]:
    """Within the block an SDPA model runs QUASAR_ATTENTION (e.g. a BF16 verifier benchmarked like
    for like with a Quasar model); its own implementation is restored afterwards."""
    original = getattr(model.config, "_attn_implementation", None)
    if original != "sdpa":
        yield
        return
    use_rowstable_attention(model)
    try:
        yield
    finally:
        model.set_attn_implementation(original)
