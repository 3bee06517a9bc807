"""StaticVerifierCache: the verifier's KV cache allocated once, for fixed-shape (compilable) steps.

A Transformers StaticCache with room for the whole generation plus one padded verify step. Every
forward writes each row's tokens at the same slots, from a shared write position; a slot mask
[B, slots] says which slots each row keeps. Rejecting drafts masks that row's slots, and the
write position moves back past the slots no row keeps: no cropping, no reallocation, no
concatenation. Positions count each row's kept tokens, so a row sees the positions and keys it
would see alone (masked keys do not change a row-stable step's bits).

After the eager prefill every step has one of two shapes, [B, 1] (decode) or [B, k + 1] (verify,
drafts padded to k), so a compiled step runs two graphs and never recompiles once warm. Finished
rows stay in the batch as idle rows (each sees only its own new token, and its outputs are
dropped), and rows that pad a batch up to a compiled step's size (compiled_steps.batch_bucket) idle
from the start. Once few enough rows are left for a smaller compiled batch whose steps have run
(`shrink`), they move to its cache and steps: speculative rows finish at different steps, and a
4-row verify step for the one row left costs 2.5 times a 1-row one (SmolLM2, 2 Zen 4 cores). Every op of
a compiled step is row-stable (our kernels) or elementwise, so a row's bits do not depend on the batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from quasar_hf import compat
from quasar_hf.ops.rowstable_attention import QUASAR_ATTENTION, QUASAR_SDPA

from .compiled_steps import batch_bucket
from .row_aligned_cache import right_aligned
from .verify_attention import long_call_kwargs

# A move to a smaller batch copies each row's slots: SmolLM2 on 2 Zen 4 cores took 2-25 ms for 230-2070 slots,
# about one decode step per this many slots, and saves a few ms per step: not worth it for the last few tokens.
MOVE_SLOTS_PER_STEP = 256
CACHE_SLOTS_STEP = 256  # cache sizes are rounded up to this: calls of similar lengths share compiled graphs
BOOL_MASK_ATTENTION = ("sdpa", QUASAR_ATTENTION, QUASAR_SDPA)  # read a 4D bool mask (True: attend) as SDPA does


# (unfinished rows, rows allocated) -> (rows, step, KV cache) of a smaller batch to continue in, or None
Shrink = Callable[[int, int], "tuple[int, Callable, StaticCacheBuffer] | None"]


def static_cache_slots(tokens: int) -> int:
    """Slots for `tokens` tokens, rounded up to a multiple of CACHE_SLOTS_STEP (a new size is a new graph)."""
    return -(-tokens // CACHE_SLOTS_STEP) * CACHE_SLOTS_STEP


@dataclass
class StaticCacheBuffer:
    """A Transformers StaticCache that outlives one call (compiled steps keep one per shape), and how many of
    its slots the last call wrote: what the next call clears before it starts."""

    cache: object
    has_sliding_layers: bool
    written: int = 0

    @classmethod
    def fresh(cls, model: torch.nn.Module, slots: int) -> StaticCacheBuffer:
        return cls(*compat.full_attention_static_cache(model, slots))

    def reset(self) -> None:
        """The cache as new: the written slots zeroed (finite values under every mask), the write position 0."""
        compat.clear_static_cache(self.cache, self.written)
        self.written = 0


class BufferSource(Protocol):
    """Steps and KV caches of `slots` slots for a batch of `rows` allocated rows."""

    slots: int

    def take(self, rows: int) -> tuple[Callable, StaticCacheBuffer]:
        """The step and a cache for `rows` rows, the taker's until given back."""
        ...

    def give_back(self, rows: int, kv: StaticCacheBuffer) -> None: ...

    def ready(self, rows: int) -> bool:
        """Whether the step for `rows` rows runs without compiling (the batch may move to that size)."""
        ...


class StaticVerifierCache:
    """Preallocated KV cache + slot mask for B rows; `forward` runs `step` (compiled or not) after an eager prefill."""

    def __init__(
        self,
        model: torch.nn.Module,
        rows: int,
        device: torch.device,
        max_cache_len: int,
        step: Callable | None = None,
        verify_kwargs: dict | None = None,
        batch_size: int | None = None,
        kv: StaticCacheBuffer | None = None,
        shrink: Shrink | None = None,
        buffers: BufferSource | None = None,
    ) -> None:
        """`rows` rows are allocated; the first `batch_size` (default: all) are the prompts' and the
        others idle from the start (padding to a compiled step's batch). `kv`: a cache to reuse (cleared
        here), else a new one. `shrink`: see `select_rows`. `buffers`: a batch that outlives its call (the
        serving engine's): rows may `join`, it moves between batch sizes itself, and `release` gives back `kv`,
        which came from `buffers`."""
        self.model = model
        self.buffers = buffers
        self.max_cache_len = max_cache_len
        self.step = step if step is not None else model
        self.shrink = shrink
        self.verify_kwargs = verify_kwargs or {}
        self.kv = kv if kv is not None else StaticCacheBuffer.fresh(model, max_cache_len)
        self.kv.reset()
        self.cache, self.has_sliding_layers = self.kv.cache, self.kv.has_sliding_layers
        batch_size = rows if batch_size is None else batch_size
        if not 1 <= batch_size <= rows:
            raise ValueError(f"a static cache of {rows} rows cannot hold a batch of {batch_size}")
        self.slot_mask = torch.zeros(rows, max_cache_len, dtype=torch.long, device=device)  # [B_all, slots]
        self.valid_len = torch.zeros(rows, dtype=torch.long, device=device)  # [B_all] kept tokens per row
        self.rows = torch.arange(batch_size, device=device)  # [B]: the unfinished rows among the B_all allocated
        self.idle_rows = torch.arange(batch_size, rows, device=device)  # [B_all - B]: padding and finished rows
        self._rows_in_order = True  # self.rows is 0..B-1 (rows that joined into idle rows may not be)
        self.length = 0  # slots in use (where the next step writes)
        self._counter = 0  # where the cache layers will write next
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kwarg = compat.cache_argument_name(model)
        self._slot_index = torch.arange(max_cache_len, device=device)  # [slots]
        self._step_mask = not self.has_sliding_layers and compat.attn_implementation(model) in BOOL_MASK_ATTENTION

    @property
    def batch_size(self) -> int:
        return self.rows.shape[0]

    def forward(
        self, tokens: torch.Tensor, token_mask: torch.Tensor | None = None, last_only: bool = False, prefill: bool = False
    ) -> torch.Tensor:
        """Write tokens [B, n] of the unfinished rows at slots length..length+n-1; fp32 logits [B, n or 1, V].

        token_mask [B, n] (1 = real token) marks padding. The first call is the prompt (eager, any
        length; with one row its left padding is dropped), and so is a call with `prefill` (the rest of prompts whose
        first tokens were `seed`ed). Later calls go through `step`."""
        fresh = self.length == 0
        prefill = fresh or prefill  # eager: a prompt, or the rest of one after a seeded prefix
        if fresh and self.batch_size < self.slot_mask.shape[0] and compat.static_cache_filled(self.cache):
            return self._prefill_real_rows(tokens, token_mask, last_only)
        everyone = self.slot_mask.shape[0]
        if token_mask is not None and everyone == 1 and not bool(token_mask.all()):
            tokens, token_mask = tokens[:, token_mask[0].bool()], None
        n = tokens.shape[1]
        if self.length + n > self.max_cache_len and self.buffers is not None and not prefill:
            self.pack()  # a long-lived batch: the holes finished rows and rejected drafts left
        if self.length + n > self.max_cache_len:
            raise RuntimeError(f"static KV cache of {self.max_cache_len} slots cannot take {n} more after {self.length}")
        new_mask = torch.ones_like(tokens) if token_mask is None else token_mask.long()  # [B, n]
        scattered = self.batch_size < everyone or not self._rows_in_order  # batch order is not allocation order
        if scattered:  # idle rows feed token 0, seen only by itself
            tokens = tokens.new_zeros(everyone, n).index_copy_(0, self.rows, tokens)
            new_mask = new_mask.new_ones(everyone, n).index_copy_(0, self.rows, new_mask)
        positions = (self.valid_len[:, None] + new_mask.cumsum(-1) - 1).clamp_min(0)  # [B_all, n]
        self.slot_mask[:, self.length : self.length + n] = new_mask
        if self._counter != self.length:  # after a rollback: no read of the device counters (a sync)
            compat.set_static_cache_length(self.cache, self.length)
        kwargs = {"logits_to_keep": 1} if (last_only and self._takes_logits_to_keep) else {}
        if n > 1 and not prefill:  # several tokens over a cache: verification
            kwargs.update(self.verify_kwargs)
        if prefill:
            kwargs.update(long_call_kwargs(self.verify_kwargs, n))
        forward = self.model if prefill else self.step
        mask = self._visible_slots(n) if self._step_mask and not prefill else self.slot_mask
        self.kv.written = max(self.kv.written, self.length + n)  # before the write: a failed step's slots count
        tokens, positions = tokens.contiguous(), positions.contiguous()  # one stride per shape: one graph
        outputs = forward(
            input_ids=tokens,
            attention_mask=mask,  # [B_all, slots] or [B_all, 1, n, slots]: explicit, or unwritten slots would count
            position_ids=positions,
            cache_position=torch.arange(self.length, self.length + n, device=tokens.device),
            use_cache=True,
            **{self._cache_kwarg: self.cache},
            **kwargs,
        )
        self.length += n
        self._counter = self.length  # the layers advanced their write counters by n
        self.valid_len = self.valid_len + new_mask.sum(-1)
        if self.batch_size < everyone:
            self.slot_mask[:, self.length - n : self.length].index_fill_(0, self.idle_rows, 0)
            self.valid_len.index_fill_(0, self.idle_rows, 0)
        logits = outputs.logits.index_select(0, self.rows) if scattered else outputs.logits
        return (logits[:, -1:] if last_only else logits).float()

    def _visible_slots(self, n: int) -> torch.Tensor:
        """bool [B_all, 1, n, slots]: slot j is visible to the step's token i when its row keeps j and j <= length + i,
        the mask Transformers builds from the 2D slot mask (causal and padding), built here once per step and
        passed as a prepared 4D mask (used as given): inside a compiled step Inductor would recompute a mask
        built in the graph for every layer that reads it (at 4 rows x 6 tokens x 4096 slots, a quarter of the step)."""
        causal = self._slot_index[None, :] <= self._slot_index[self.length : self.length + n, None]  # [n, slots]
        return (self.slot_mask[:, None, :].bool() & causal[None])[:, None]

    def _prefill_real_rows(self, tokens: torch.Tensor, token_mask: torch.Tensor | None, last_only: bool) -> torch.Tensor:
        """The prompt of a batch padded up to a compiled step's rows, over its real rows only: the rows that pad
        the batch idle with no keys, so running their prompt-length prefill (a third of the work for 3 prompts in
        a 4-row step) is skipped. The real rows are the first ones, so the cache's first rows take the prefill
        in place; a cache not filled yet (its first call) prefills every row and allocates them."""
        rows = self.batch_size
        if token_mask is not None and rows == 1 and not bool(token_mask.all()):  # one prompt: its padding goes
            tokens, token_mask = tokens[:, token_mask[0].bool()], None
        n = tokens.shape[1]
        new_mask = torch.ones_like(tokens) if token_mask is None else token_mask.long()  # [B, n]
        positions = (new_mask.cumsum(-1) - 1).clamp_min(0)  # [B, n]: a fresh cache, valid_len 0
        self.slot_mask[:rows, :n] = new_mask
        kwargs = {"logits_to_keep": 1} if (last_only and self._takes_logits_to_keep) else {}
        kwargs.update(long_call_kwargs(self.verify_kwargs, n))
        self.kv.written = max(self.kv.written, n)
        with compat.static_cache_first_rows(self.cache, rows):
            outputs = self.model(
                input_ids=tokens.contiguous(),
                attention_mask=self.slot_mask[:rows],  # [B, slots]
                position_ids=positions.contiguous(),
                cache_position=torch.arange(n, device=tokens.device),
                use_cache=True,
                **{self._cache_kwarg: self.cache},
                **kwargs,
            )
        self.length = self._counter = n
        self.valid_len = self.valid_len.index_add(0, self.rows, new_mask.sum(-1))
        logits = outputs.logits
        return (logits[:, -1:] if last_only else logits).float()

    def seed(self, prefixes: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Start each prompt row from keys and values computed earlier (a prompt cache's): prefixes[b] holds each
        layer's [1, H, P_b, D]. Rows are right-aligned, a shorter one's missing slots masked; the next forward (the
        rest of the prompts, `forward(..., prefill=True)`) runs eagerly."""
        if self.length or len(prefixes) != self.batch_size or self.has_sliding_layers:
            raise ValueError("cached prefixes seed an empty static cache of full-attention layers, one prefix per row")
        lengths = torch.tensor([prefix[0][0].shape[-2] for prefix in prefixes], device=self.valid_len.device)
        width = int(lengths.max())
        layers = [
            tuple(right_aligned([prefix[index][part] for prefix in prefixes], width) for part in (0, 1))
            for index in range(len(prefixes[0]))
        ]
        compat.fill_static_cache(self.cache, self.slot_mask.shape[0], layers)
        self.valid_len[: self.batch_size] = lengths
        slots = torch.arange(width, device=lengths.device)[None, :]
        self.slot_mask[: self.batch_size, :width] = (slots >= width - lengths[:, None]).long()
        self.length = self._counter = width
        self.kv.written = max(self.kv.written, width)

    def row_key_values(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Unfinished row `index`'s keys and values of its kept tokens, holes left out: each layer's [1, H, n, D]."""
        row = int(self.rows[index])
        slots = self.slot_mask[row, : self.length].nonzero().squeeze(-1)
        return [(k[row : row + 1, :, slots], v[row : row + 1, :, slots]) for k, v in compat.static_cache_tensors(self.cache)]

    def keep_accepted(self, num_keep: torch.Tensor, num_appended: int) -> None:
        """Of the last `num_appended` slots keep the first num_keep[b] per unfinished row."""
        start = self.length - num_appended
        keep = torch.zeros_like(self.valid_len).index_copy_(0, self.rows, num_keep.long())  # [B_all]
        drop = torch.arange(num_appended, device=keep.device)[None] >= keep[:, None]  # [B_all, n]
        appended = self.slot_mask[:, start : self.length]
        self.valid_len = self.valid_len - (appended * drop).sum(-1)
        appended.masked_fill_(drop, 0)
        self._move_back_to(start + int(keep.max()))

    def drop_last_tokens(self, counts: torch.Tensor) -> None:
        """Forget the last counts[b] kept tokens of each unfinished row (roll back a drafter's own tokens)."""
        counts = torch.zeros_like(self.valid_len).index_copy_(0, self.rows, counts.long())  # [B_all]
        kept_from_right = self.slot_mask.flip(-1).cumsum(-1).flip(-1)  # [B_all, slots]: kept slots at or after
        self.slot_mask.masked_fill_((self.slot_mask == 1) & (kept_from_right <= counts[:, None]), 0)
        self.valid_len = self.valid_len - counts.clamp(max=self.valid_len)
        used = self.slot_mask.any(dim=0).nonzero()
        self._move_back_to(int(used.max()) + 1 if used.numel() else 0)

    def select_rows(self, rows: torch.Tensor, tokens_left: int | None = None) -> None:
        """Keep only `rows` of the unfinished rows; the others stay allocated, idle, with no keys. With `shrink`
        (compiled steps) the rows left move to a smaller batch's cache and steps where it offers one, unless
        `tokens_left`, the most tokens a row left still owes, is too few to pay for the move (MOVE_SLOTS_PER_STEP)."""
        self.rows = self.rows[rows]
        idle = torch.ones(self.slot_mask.shape[0], dtype=torch.bool, device=self.rows.device)
        self.idle_rows = idle.index_fill_(0, self.rows, False).nonzero()[:, 0]
        self.slot_mask.index_fill_(0, self.idle_rows, 0)
        self.valid_len.index_fill_(0, self.idle_rows, 0)
        used = self.slot_mask.any(dim=0).nonzero()
        self._move_back_to(int(used.max()) + 1 if used.numel() else 0)
        worth_it = tokens_left is None or tokens_left * MOVE_SLOTS_PER_STEP >= self.length
        if self.shrink is not None and 0 < self.batch_size and not self.has_sliding_layers and worth_it:
            smaller = self.shrink(self.batch_size, self.slot_mask.shape[0])
            if smaller is not None:
                self._move_rows_to(*smaller)
        if self.buffers is not None and 0 < self.batch_size and worth_it:
            smaller = batch_bucket(self.batch_size)
            if smaller < self.slot_mask.shape[0] and self.buffers.ready(smaller):
                self._move_to_buffers(smaller)

    def join(self, other: StaticVerifierCache) -> None:
        """Append `other`'s unfinished rows (prompts prefilled alone) after these, in idle rows (moving to a larger
        batch size when too few are idle). Rows are right-aligned at the shared write position: a row's kept slots
        end where the others' do, the slots before them masked. Each row keeps its tokens, positions and visible
        keys (a larger cache only adds unused slots), so row-stable steps give it the bits it gets alone."""
        if self.buffers is None or other.max_cache_len > self.max_cache_len or self.has_sliding_layers:
            raise ValueError(
                "rows join a static batch made for joining (buffers=...), of at least their cache size, over full-attention "
                "layers"
            )
        count = other.batch_size
        if self.idle_rows.shape[0] < count:
            self._move_to_buffers(batch_bucket(self.batch_size + count))
        if other.length > self.length:
            self._make_room_before(other.length - self.length)
        targets, start = self.idle_rows[:count], self.length - other.length
        for (keys, values), (their_keys, their_values) in zip(
            compat.static_cache_tensors(self.cache), compat.static_cache_tensors(other.cache)
        ):
            keys[targets, :, start : self.length] = their_keys[other.rows, :, : other.length]
            values[targets, :, start : self.length] = their_values[other.rows, :, : other.length]
        self.slot_mask[targets, start : self.length] = other.slot_mask[other.rows, : other.length]
        self.valid_len[targets] = other.valid_len[other.rows]
        self.rows = torch.cat([self.rows, targets])
        self.idle_rows = self.idle_rows[count:]
        self._rows_in_order = self.rows.tolist() == list(range(self.batch_size))

    def release(self) -> None:
        """Give the cache back to `buffers` (the batch is over, or its rows joined another)."""
        if self.buffers is not None:
            self.buffers.give_back(self.slot_mask.shape[0], self.kv)
            self.buffers = None

    def _move_to_buffers(self, rows: int) -> None:
        """Continue in a cache of `rows` allocated rows taken from `buffers`; the old one goes back."""
        old_rows, old_kv = self.slot_mask.shape[0], self.kv
        self._move_rows_to(rows, *self.buffers.take(rows))
        self.buffers.give_back(old_rows, old_kv)

    def _make_room_before(self, count: int) -> None:
        """Shift every row's slots `count` to the right (packing them first when the cache is too short), so that a
        longer row can join right-aligned. Slot indices are not positions: no row's bits change."""
        if self.length + count > self.max_cache_len:
            self.pack()
        if self.length + count > self.max_cache_len:
            raise RuntimeError(f"static KV cache of {self.max_cache_len} slots cannot hold {self.length + count}")
        length = self.length
        for keys, values in compat.static_cache_tensors(self.cache):
            keys[:, :, count : count + length] = keys[:, :, :length].clone()
            values[:, :, count : count + length] = values[:, :, :length].clone()
        self.slot_mask[:, count : count + length] = self.slot_mask[:, :length].clone()
        self.slot_mask[:, :count] = 0
        self.length = self._counter = length + count
        compat.set_static_cache_length(self.cache, self.length)
        self.kv.written = max(self.kv.written, self.length)

    def pack(self) -> None:
        """Close the holes: each row's kept slots, in order, move to the end of the first max(valid_len) slots
        (the slots a long-lived batch leaves behind: finished rows' and rejected drafts'). Slot indices are not
        positions, so no row's bits change."""
        kept = self.slot_mask[:, : self.length].bool()  # [B_all, L]
        width = int(self.valid_len.max()) if self.valid_len.numel() else 0
        order = torch.argsort((~kept).to(torch.uint8), dim=-1, stable=True)  # [B_all, L]: kept slots first, in order
        target = torch.arange(width, device=kept.device)[None, :] - (width - self.valid_len[:, None])  # [B_all, W]
        holds = target >= 0
        source = torch.where(holds, order.gather(1, target.clamp(0, max(self.length - 1, 0))), 0)  # [B_all, W]
        for keys, values in compat.static_cache_tensors(self.cache):
            for part in (keys, values):
                index = source[:, None, :, None].expand(-1, part.shape[1], -1, part.shape[3])
                part[:, :, :width] = part.gather(2, index)
        self.slot_mask[:, :width] = holds.long()
        self.slot_mask[:, width : self.length] = 0
        self.length = self._counter = width
        compat.set_static_cache_length(self.cache, width)

    def _move_rows_to(self, rows: int, step: Callable, kv: StaticCacheBuffer) -> None:
        """Continue in `kv`, a cache of `rows` rows run by `step`: the unfinished rows' keys, values and slot
        masks move to its first rows (in order), so a step stops computing the finished rows. Each row's
        tokens, positions and visible keys stay what they were: row-stable steps give it the same bits."""
        kv.reset()
        compat.copy_static_cache_rows(self.cache, kv.cache, rows, self.rows, self.length)
        kv.written = self.length
        slot_mask = torch.zeros(rows, self.max_cache_len, dtype=self.slot_mask.dtype, device=self.slot_mask.device)
        slot_mask[: self.batch_size] = self.slot_mask[self.rows]
        valid_len = torch.zeros(rows, dtype=self.valid_len.dtype, device=self.valid_len.device)
        valid_len[: self.batch_size] = self.valid_len[self.rows]
        self.slot_mask, self.valid_len, self.kv, self.cache, self.step = slot_mask, valid_len, kv, kv.cache, step
        self.rows = torch.arange(self.batch_size, device=self.rows.device)
        self.idle_rows = torch.arange(self.batch_size, rows, device=self.rows.device)
        self._rows_in_order = True
        self._counter = self.length  # copy_static_cache_rows set the new cache's write position

    def check_holes_supported(self) -> None:
        """Masked slots among kept ones need full attention: a sliding window counts slots, not tokens."""
        if self.has_sliding_layers:
            raise ValueError(
                "Speculative generation with batch size > 1 needs full-attention layers, but this model uses "
                "sliding-window attention. Run one prompt at a time (batch size 1) for this model."
            )

    def _move_back_to(self, length: int) -> None:
        self.slot_mask[:, length : self.length] = 0
        self.length = length
