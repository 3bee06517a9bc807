"""Row-stable attention as Transformers attention functions: verification rows bit-identical to decode steps.

Why: torch's SDPA with q_len = k+1 takes another code path than decode's q_len = 1, so its outputs
differ in the last bits. In a W8A8 model such a difference can flip the INT8 rounding of a
per-token activation, and the flipped K/V of one position then shifts every later logit. The INT8
GEMMs (per-token scales, exact int32 accumulation), norms, rotary and MLP are row-independent
already; attention is the one shape-dependent op.

Two registered attention implementations:
* `QUASAR_ATTENTION` ("quasar_rowstable", what Quasar models load with; `use_rowstable_attention`
  switches any SDPA model): every decode and verify call runs a kernel that computes each query
  row alone (`attention_cpu` on CPU in float32/bfloat16, `triton_attention` on CUDA), so a
  verified row equals its decode step by construction, in one batched call. Where no kernel
  applies (CPU float16, a device where the Triton kernel fails its first-use check) it is SDPA. A long
  prefill runs the prompt kernel (`attention_cpu.prefill_attention`, CPU bfloat16 with AVX2 + FMA)
  or SDPA; a left-padded batch's long prefill runs it per row on that row's own tokens, the call a
  request alone makes, so a served batch gives each request its own bits. A long prompt over a cache
  (a chat's next turn: more than LONG_PREFILL_ROWS rows, every row seeing all keys up to its own)
  runs the prompt kernel too, over the cached keys; plain and speculative generation make that same
  call. A batch with holes or padding, a window, or fewer rows keeps the row-stable kernel.
* `QUASAR_SDPA` ("quasar_sdpa"): plain SDPA, for SDPA models during one speculative call.
Both take the forward keyword `quasar_rowstable=True` (Transformers passes a forward's extra keyword
arguments through to the attention function): a multi-token call over a cache that no kernel
computes then runs SDPA once per query row, on exactly the keys a decode step would see (exact,
one SDPA call per row). Without it they never split a call.

What a long prefill's branches read from the mask (each row's padding, whether an empty static cache's
unwritten slots are masked, whether a prompt over a cache is bottom-right causal) needs the host to read the
mask. A forward that passes `quasar_mask_facts=MaskFacts()` has each of those found by its first layer and
reused by the others (Transformers hands every layer the same mask): one host read per forward, not one per
layer. The facts are the same either way, so the kernels and the bits are too.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from quasar_hf import compat
from quasar_hf.ops import attention_cpu

QUASAR_ATTENTION = "quasar_rowstable"
QUASAR_SDPA = "quasar_sdpa"
ROWSTABLE_KWARG = "quasar_rowstable"  # forward keyword asking for verification rows equal to decode steps
MASK_FACTS_KWARG = "quasar_mask_facts"  # forward keyword: a MaskFacts shared by the forward's layers
# A prefill longer than this, fresh or over a cache (a chat's next turn), takes the prompt kernel where it
# applies: it is the same call in plain and speculative generation, so it needs no row stability, only speed.
# A verify call (forward keyword quasar_rowstable=True) of more rows keeps the row-stable kernel: its rows
# must equal decode steps.
LONG_PREFILL_ROWS = 64
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


class MaskFacts:
    """What one forward's layers read from its attention mask, found once (see the module docstring).

    A fact is kept under its name, the mask's identity (a model's sliding and full-attention layers get
    different masks) and the call's shape; a mask that is no longer the one a fact was found on (another
    tensor at the same address) is read again."""

    def __init__(self) -> None:
        self._known: dict[tuple, tuple[weakref.ref | None, Any]] = {}
        self.reads = 0  # facts found by reading a mask (a layer that reused one did not read)

    def get(self, mask: torch.Tensor | None, name: str, shape: tuple[int, ...], find: Callable[[], Any]) -> Any:
        """`find()` (a read of `mask`, the mask the forward was given), or its answer for this forward's earlier layer."""
        key = (name, shape) if mask is None else (name, shape, mask.data_ptr(), tuple(mask.shape), mask.stride())
        known = self._known.get(key)
        if known is not None and (mask is None or known[0]() is mask):
            return known[1]
        value = find()
        self.reads += 1
        self._known[key] = (None if mask is None else weakref.ref(mask), value)
        return value


Remember = Callable[[str, tuple, Callable[[], Any]], Any]  # MaskFacts.get bound to the mask the forward was given


def _found(remember: Remember | None, name: str, shape: tuple[int, ...], find: Callable[[], Any]) -> Any:
    """`find()`, or the forward's earlier answer to it when the forward passed MaskFacts."""
    return find() if remember is None else remember(name, shape, find)


def _visible_keys(attention_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor):
    """bool [B, Q, N] from SDPA's mask [B, 1, Q, >=N]; False if unusable.

    None is Transformers' "SDPA can use is_causal" (masking_utils skips the mask): one query row
    sees every key, Q == N rows are causal (both stay None: the kernel's causal rows), and
    1 < Q < N, a prefill into an empty static cache, is top-left causal (row i sees keys 0..i)."""
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is None:
        if 1 < q_len < kv_len:
            rows = torch.arange(q_len, device=key.device)[:, None]
            return (torch.arange(kv_len, device=key.device)[None, :] <= rows).expand(batch, q_len, kv_len)
        return None
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return False
    if attention_mask.shape[2] != q_len or attention_mask.shape[3] < kv_len:
        return False
    return attention_mask[:, 0, :, :kv_len].expand(batch, q_len, kv_len)


def rowstable_kernel_for(query, key, value):
    """The op `quasar::rowstable_attention` when it has a kernel for these tensors (C on CPU, Triton on
    CUDA), else None."""
    if query.device.type == "cpu":
        supported = attention_cpu.supports(query, key, value)
    elif query.device.type == "cuda":
        try:
            from quasar_hf.ops import triton_attention
        except ImportError:
            return None
        supported = triton_attention.supports(query, key, value)
    else:
        supported = False
    return _attention_op if supported else None


def decide_kernels(device: str | torch.device) -> bool:
    """Run, eagerly and once per process, the first-use checks a step on `device` reads (the row-stable
    attention kernel: C on CPU, Triton on CUDA); True when it serves that device. Called before a step is
    compiled (and when a model is switched to QUASAR_ATTENTION), so traced code only reads decided
    constants and never runs a check itself."""
    device = torch.device(device)
    if device.type == "cpu":
        return attention_cpu.serves()
    if device.type == "cuda":
        try:
            from quasar_hf.ops import triton_attention
        except ImportError:
            return False
        return triton_attention.triton is not None and triton_attention.works_on(device)
    return False


def _attention_op(query, key, value, visible, scale):
    return torch.ops.quasar.rowstable_attention(query, key, value, visible, None if scale is None else float(scale))


def _kernel_inputs(module, query, key, value, attention_mask, dropout, kwargs):
    """(kernel, visible) when a row-stable kernel computes this call; (None, None) otherwise."""
    if dropout or not getattr(module, "is_causal", True) or any(kwargs.get(k) is not None for k in _UNSUPPORTED_KWARGS):
        return None, None
    kernel = rowstable_kernel_for(query, key, value)
    visible = _visible_keys(attention_mask, query, key) if kernel is not None else False
    if visible is None:  # Transformers' masks carry the window; a call without one gets it here
        visible = _within_sliding_window(query, key, kwargs.get("sliding_window"))
    return (None, None) if visible is False else (kernel, visible)


def _within_sliding_window(query: torch.Tensor, key: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """For a call without a mask (one row over its keys, or Q == N causal rows): the causal rows
    limited to the last `window` keys of each (key j visible from row position p iff
    p - window < j <= p, as Transformers' sliding masks say); None when the window covers them."""
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if not window or kv_len <= window:
        return None
    rows = torch.arange(kv_len - q_len, kv_len, device=key.device)[:, None]  # [Q, 1] key index of each row
    cols = torch.arange(kv_len, device=key.device)[None, :]  # [1, N]
    band = (cols <= rows) & (cols > rows - window)  # [Q, N]
    return band.expand(batch, q_len, kv_len)


def _sdpa_row_by_row(module, query, key, value, attention_mask, **kwargs):
    """SDPA with query [B, H, q, D] split into q one-row calls, each on the keys its decode step saw."""
    q_len, kv_len = query.shape[2], key.shape[2]
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


def _verifying_over_cache(query: torch.Tensor, key: torch.Tensor, rowstable: bool) -> bool:
    return rowstable and 1 < query.shape[2] < key.shape[2]


def _left_padding(query, key, attention_mask, kwargs, remember: Remember | None = None) -> list[int] | None:
    """Each row's left padding when this is a fresh prefill (Q == N) of a left-padded batch, else None."""
    if attention_mask is None or query.shape[0] == 1 or kwargs.get("sliding_window") is not None:
        return None
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[-1] < key.shape[2]:
        return None
    kv_len = key.shape[2]

    def find() -> list[int]:
        sees = attention_mask[:, 0, -1, :kv_len]  # [B, N]: the keys each row's last token sees
        return (~sees).int().cumprod(-1).sum(-1).tolist()  # leading masked keys: the row's padding

    pads = _found(remember, "left_padding", (kv_len,), find)
    return pads if any(pads) and max(pads) < kv_len else None


def _fresh_static_prefill(
    attention_mask, q_len: int, kv_len: int, sliding_window: int | None = None, remember: Remember | None = None
) -> bool:
    """A long prefill into an empty static cache: no row sees a key past the first `q_len` slots (the prompt's).
    It then runs as a prefill over its own keys (SDPA), not over the cache's unwritten slots, whether one
    row (no mask: causal from the first slot, which sees nothing past `q_len` either) or a left-padded batch."""
    if attention_mask is None:
        return sliding_window is None  # a window without a mask is applied by the kernel, over the slots
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return False
    if attention_mask.shape[-1] < kv_len:
        return False
    unwritten_seen = _found(remember, "past_prompt", (q_len, kv_len), lambda: bool(attention_mask[..., q_len:kv_len].any()))
    return not unwritten_seen


def _plain_causal(module, dropout, kwargs) -> bool:
    """No dropout, a causal module, none of the score modifiers the prompt kernel lacks."""
    plain = not dropout and getattr(module, "is_causal", True) and kwargs.get("is_causal", True) is not False
    return plain and all(kwargs.get(k) is None for k in _UNSUPPORTED_KWARGS)


def _continues_prompt(module, query, key, value, attention_mask, dropout, kwargs, remember: Remember | None = None) -> bool:
    """True for a long prompt over a cache (no verify call: the caller asks) that the prompt kernel computes:
    Q > LONG_PREFILL_ROWS query rows, the last Q of N > Q keys, and a bool mask [B, 1, Q, >=N] that is exactly
    bottom-right causal over the N keys in every row (row i sees keys 0 .. N - Q + i: no holes, no padding, no
    window). A mask of None is no such call here: with Q < N it means top-left causal (a prefill into an
    empty static cache, see `_visible_keys`)."""
    q_len, kv_len, window = query.shape[2], key.shape[2], kwargs.get("sliding_window")
    if not (LONG_PREFILL_ROWS < q_len < kv_len) or attention_mask is None or not _plain_causal(module, dropout, kwargs):
        return False
    if window and kv_len > window:  # a mask that carries the window fails the check below; one without it, here
        return False
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        return False
    if attention_mask.shape[2] != q_len or attention_mask.shape[3] < kv_len:
        return False
    if not attention_cpu.prefill_supports(query, key, value):
        return False
    return _found(
        remember,
        "bottom_right_causal",
        (q_len, kv_len),
        lambda: _bottom_right_causal(attention_mask[:, 0, :, :kv_len]),
    )


def _bottom_right_causal(mask: torch.Tensor) -> bool:
    """True if bool `mask` [B, Q, N] is row i sees keys 0 .. N - Q + i, in every row. Cheaper than comparing all
    Q x N entries (this runs in every layer): row i holds N - Q + 1 + i visible keys and, past key N - Q, exactly
    keys N - Q + 1 .. N - Q + i, so the N - Q + 1 keys before are all visible."""
    q_len, kv_len = mask.shape[-2], mask.shape[-1]
    counts = mask.view(torch.uint8).sum(-1, dtype=torch.int32)  # [B, Q]
    expected = torch.arange(kv_len - q_len + 1, kv_len + 1, dtype=torch.int32, device=mask.device)
    if not torch.equal(counts, expected.expand_as(counts)):
        return False
    tail = mask[..., kv_len - q_len + 1 :]  # [B, Q, Q - 1]
    return torch.equal(tail, torch.ones(q_len, q_len - 1, dtype=torch.bool, device=mask.device).tril(-1).expand_as(tail))


def _prompt_attention(module, query, key, value, dropout=0.0, scaling=None, **kwargs):
    """A long prompt's causal self-attention (Q == N, no mask): `attention_cpu.prefill_attention` (the
    prompt kernel) where it applies, else SDPA. Returns ([B, L, H, D], None)."""
    window = kwargs.get("sliding_window")
    plain = _plain_causal(module, dropout, kwargs) and (not window or query.shape[2] <= window)
    if plain and attention_cpu.prefill_supports(query, key, value):
        return attention_cpu.prefill_attention(query, key, value, scaling), None
    return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)


def _prefill_each_row(module, query, key, value, pads, **kwargs):
    """A left-padded batch's long prefill as each row's own call on its unpadded tokens: the call a
    request alone makes (mask None, causal: the prompt attention, or the row-stable kernel for a row of
    at most LONG_PREFILL_ROWS tokens), so a batched row gets that request's bits. Padding rows out: 0."""
    outputs = []
    for row, pad in enumerate(pads):
        rows = [t[row : row + 1, :, pad:].contiguous() for t in (query, key, value)]
        out, _ = rowstable_attention_forward(module, *rows, None, **kwargs)  # [1, N - pad, H, D]
        outputs.append(torch.nn.functional.pad(out, (0, 0, 0, 0, pad, 0)))
    return torch.cat(outputs), None


def rowstable_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    quasar_rowstable: bool = False,
    quasar_mask_facts: MaskFacts | None = None,
    **kwargs,
):
    """QUASAR_ATTENTION: the row-stable kernel where it applies, else SDPA (row by row when verifying; each
    row on its own tokens for a left-padded batch's long prefill, as it runs alone). A long prefill, alone or
    over a cache, takes the prompt kernel where it applies; `quasar_mask_facts`: the forward's MaskFacts."""
    q_len, kv_len = query.shape[2], key.shape[2]
    # facts found by this forward's first layer, keyed by the mask it was given (before any slicing below)
    remember = None if quasar_mask_facts is None else functools.partial(quasar_mask_facts.get, attention_mask)
    if q_len > LONG_PREFILL_ROWS and kv_len > q_len and not torch.compiler.is_compiling():
        if _fresh_static_prefill(
            attention_mask, q_len, kv_len, kwargs.get("sliding_window"), remember
        ):  # an empty static cache: its unwritten slots go
            key, value = key[:, :, :q_len], value[:, :, :q_len]
            attention_mask = None if attention_mask is None else attention_mask[..., :q_len]
            kv_len = q_len
    if q_len == kv_len and q_len > LONG_PREFILL_ROWS and not torch.compiler.is_compiling():
        pads = _left_padding(query, key, attention_mask, kwargs, remember)
        if pads is not None:
            return _prefill_each_row(module, query, key, value, pads, dropout=dropout, scaling=scaling, **kwargs)
    if q_len < kv_len and not quasar_rowstable and not torch.compiler.is_compiling():
        if _continues_prompt(module, query, key, value, attention_mask, dropout, kwargs, remember):
            return attention_cpu.prefill_attention(query, key, value, scaling), None
    if not (q_len == kv_len and q_len > LONG_PREFILL_ROWS):
        kernel, visible = _kernel_inputs(module, query, key, value, attention_mask, dropout, kwargs)
        if kernel is not None:
            return kernel(query, key, value, visible, scaling), None
    if _verifying_over_cache(query, key, quasar_rowstable):
        return _sdpa_row_by_row(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if attention_mask is None and q_len == kv_len > LONG_PREFILL_ROWS and not torch.compiler.is_compiling():
        return _prompt_attention(module, query, key, value, dropout=dropout, scaling=scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def rowstable_sdpa_attention(
    module, query, key, value, attention_mask, quasar_rowstable: bool = False, quasar_mask_facts: Any = None, **kwargs
):
    """QUASAR_SDPA: plain SDPA; one call per query row when verifying over a cache (`quasar_mask_facts`: unused)."""
    if _verifying_over_cache(query, key, quasar_rowstable):
        return _sdpa_row_by_row(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


ATTENTION_FUNCTIONS = {QUASAR_ATTENTION: rowstable_attention_forward, QUASAR_SDPA: rowstable_sdpa_attention}


def register_attention() -> None:
    """Register both attention functions (with SDPA's mask builder) with Transformers; idempotent."""
    for name, function in ATTENTION_FUNCTIONS.items():
        compat.register_attention_function(name, function)


def use_rowstable_attention(model: torch.nn.Module) -> bool:
    """Switch an SDPA model to QUASAR_ATTENTION (decode and verification rows bit-identical).

    Returns True if switched. Models on another attention implementation (eager, flash, ...) are
    left alone: the user chose it.
    """
    if compat.attn_implementation(model) not in ("sdpa", QUASAR_ATTENTION):
        return False
    register_attention()
    for device in {p.device for p in model.parameters() if p.device.type != "meta"}:
        decide_kernels(device)  # now, not inside a traced step (kernels unavailable: SDPA runs instead)
    model.set_attn_implementation(QUASAR_ATTENTION)
    return compat.attn_implementation(model) == QUASAR_ATTENTION
