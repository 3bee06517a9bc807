"""RowAlignedCache: one KV cache for B rows that each advance by their own number of tokens.

Every forward appends the same number of slots to every row (the cache stays rectangular).
Slots a row does not keep (rejected drafts, right padding of a ragged chunk) become masked
holes; trailing slots that no row keeps are cropped away, so with batch size 1 the cache is
always exactly the accepted prefix. Positions come from the number of real tokens per row,
so a row sees the same positions and keys as it would alone.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from quasar_hf import compat

from .append_in_place import AppendInPlaceLayer
from .verify_attention import long_call_kwargs


class RowAlignedCache:
    """KV cache + slot mask [B, S] + real-token count [B] for one causal LM."""

    def __init__(self, model: torch.nn.Module, batch_size: int, device: torch.device, verify_kwargs: dict | None = None) -> None:
        self.model = model
        self.verify_kwargs = verify_kwargs or {}  # forward keywords of multi-token calls over the cache (verify_attention.py)
        self.cache = DynamicCache(config=model.config)
        # Sliding-window layers (Gemma 3, Mistral-style windows) drop keys that leave the window, after
        # which rejected drafts cannot be cropped away. Keep full layers instead: the model's sliding
        # mask still limits every query to its window, so each row sees exactly the keys it would in
        # plain decoding (the row-stable kernel skips masked keys, so the bits match too).
        self.has_sliding_layers = any(getattr(layer, "is_sliding", False) for layer in self.cache.layers)
        if self.has_sliding_layers:
            self.cache = DynamicCache()
        elif _reads_strided_cache(model, device):
            compat.append_kv_in_place(self.cache, AppendInPlaceLayer)  # appends write into spare room: no concatenation per step
        self.slot_mask = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # [B, S]
        self.valid_len = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B]
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_kwarg = compat.cache_argument_name(model)

    @property
    def batch_size(self) -> int:
        return self.slot_mask.shape[0]

    def seed(self, prefixes: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Start each row from keys and values already computed for its first tokens: prefixes[b] holds each
        layer's [1, H, P_b, D] for row b. Rows are right-aligned; a shorter row's missing slots are masked holes."""
        if len(prefixes) != self.batch_size or self.slot_mask.shape[1] != 0 or self.has_sliding_layers:
            raise ValueError("cached prefixes seed an empty cache of full-attention layers, one prefix per row")
        lengths = [prefix[0][0].shape[-2] for prefix in prefixes]
        width = max(lengths)
        for index in range(len(prefixes[0])):
            keys, values = (right_aligned([prefix[index][part] for prefix in prefixes], width) for part in (0, 1))
            self.cache.update(keys, values, index)
        device = self.slot_mask.device
        self.valid_len = torch.tensor(lengths, dtype=torch.long, device=device)
        self.slot_mask = (torch.arange(width, device=device)[None, :] >= width - self.valid_len[:, None]).long()

    def row_key_values(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row `index`'s keys and values of its real tokens, holes left out: each layer's [1, H, valid_len, D]."""
        slots = self.slot_mask[index].nonzero().squeeze(-1)
        return [(k[index : index + 1, :, slots], v[index : index + 1, :, slots]) for k, v in compat.cache_key_values(self.cache)]

    def join(self, other: RowAlignedCache) -> None:
        """Append `other`'s rows (their own keys, computed alone) below these. Both are right-aligned to the wider
        one: the narrower side's missing slots are masked holes, which no row attends to."""
        if self.has_sliding_layers or other.has_sliding_layers:
            raise ValueError("rows join a running batch only over full-attention KV layers")
        width = max(self.slot_mask.shape[1], other.slot_mask.shape[1])
        mine, theirs = _filled_key_values(self.cache), _filled_key_values(other.cache)
        template = mine or theirs
        if template:
            joined = []
            for index, layer in enumerate(template):
                joined.append(
                    tuple(
                        torch.cat(
                            [
                                _rows_at_width(mine, index, part, self.batch_size, width, layer[part]),
                                _rows_at_width(theirs, index, part, other.batch_size, width, layer[part]),
                            ]
                        )
                        for part in (0, 1)
                    )
                )
            compat.replace_cache_key_values(self.cache, joined)
        masks = [torch.nn.functional.pad(m, (width - m.shape[1], 0)) for m in (self.slot_mask, other.slot_mask)]
        self.slot_mask = torch.cat(masks)
        self.valid_len = torch.cat([self.valid_len, other.valid_len])

    def add_empty_rows(self, count: int) -> None:
        """Append `count` rows holding nothing yet (every slot a hole): their tokens come with the next forward."""
        width = self.slot_mask.shape[1]
        key_values = _filled_key_values(self.cache)
        if key_values and width:
            grown = [tuple(torch.cat([t, t.new_zeros(count, *t.shape[1:])]) for t in kv) for kv in key_values]
            compat.replace_cache_key_values(self.cache, grown)
        self.slot_mask = torch.cat([self.slot_mask, self.slot_mask.new_zeros(count, width)])
        self.valid_len = torch.cat([self.valid_len, self.valid_len.new_zeros(count)])

    def forward(
        self, tokens: torch.Tensor, token_mask: torch.Tensor | None = None, last_only: bool = False, prefill: bool = False
    ) -> torch.Tensor:
        """Append tokens [B, n] (token_mask [B, n]: 1 = real token) and return fp32 logits [B, n or 1, V].

        prefill: these are the prompt's tokens (over a cached prefix, if any), not drafts to verify: the call
        plain generate makes, without the verify keywords."""
        if token_mask is None:
            token_mask = torch.ones_like(tokens)
        positions = self.valid_len[:, None] + token_mask.cumsum(-1) - 1  # [B, n]
        positions = positions.masked_fill(token_mask == 0, 0)
        full_mask = torch.cat([self.slot_mask, token_mask], dim=1)  # [B, S + n]
        # Like plain generate: an all-ones mask is dropped so attention takes the same (maskless) path.
        attention_mask = None if bool(full_mask.all()) else full_mask
        kwargs = {"logits_to_keep": 1} if (last_only and self._takes_logits_to_keep) else {}
        if tokens.shape[1] > 1 and self.slot_mask.shape[1] > 0 and not prefill:  # several tokens over a cache: verification
            kwargs.update(self.verify_kwargs)
        kwargs.update(long_call_kwargs(self.verify_kwargs, tokens.shape[1]))
        outputs = self.model(
            input_ids=tokens,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: self.cache},
            **kwargs,
        )
        self.slot_mask = full_mask
        self.valid_len = self.valid_len + token_mask.sum(-1)
        logits = outputs.logits
        return (logits[:, -1:] if last_only else logits).float()

    def keep_accepted(self, num_keep: torch.Tensor, num_appended: int) -> None:
        """Of the last `num_appended` slots keep the first num_keep[b] per row; mask the rest."""
        start = self.slot_mask.shape[1] - num_appended
        offsets = torch.arange(num_appended, device=self.slot_mask.device)
        drop = offsets[None, :] >= num_keep[:, None]  # [B, n]
        appended = self.slot_mask[:, start:]
        self.valid_len = self.valid_len - (appended * drop).sum(-1)
        self.slot_mask = torch.cat([self.slot_mask[:, :start], appended.masked_fill(drop, 0)], dim=1)
        self._crop_empty_tail()

    def drop_last_tokens(self, counts: torch.Tensor) -> None:
        """Forget the last counts[b] real tokens of each row (roll back a drafter's own tokens)."""
        valid_from_right = self.slot_mask.flip(-1).cumsum(-1).flip(-1)  # [B, S]: real tokens at or after slot
        drop = (self.slot_mask == 1) & (valid_from_right <= counts[:, None])
        self.slot_mask = self.slot_mask.masked_fill(drop, 0)
        self.valid_len = self.valid_len - counts.clamp(max=self.valid_len)
        self._crop_empty_tail()

    def select_rows(self, rows: torch.Tensor, tokens_left: int | None = None) -> None:
        """Keep only `rows` (finished rows leave the batch and stop costing compute; `tokens_left` is not needed)."""
        self.cache.batch_select_indices(rows)
        self.slot_mask = self.slot_mask[rows]
        self.valid_len = self.valid_len[rows]
        self._crop_empty_tail()
        self._crop_empty_head()

    def check_holes_supported(self) -> None:
        """Masked holes need plain full-attention layers (a sliding window counts slots, not tokens)."""
        kinds = ["sliding-window attention"] if self.has_sliding_layers else []
        kinds += [type(layer).__name__ for layer in self.cache.layers if not compat.is_full_attention_layer(layer)]
        if kinds:
            raise ValueError(
                f"Speculative generation with batch size > 1 needs full-attention KV layers, but this model uses "
                f"{kinds[0]}. Run one prompt at a time (batch size 1) for this model."
            )

    def _crop_empty_head(self) -> None:
        """Remove leading slots that no row uses any more (rows that left a long-lived batch), once they are at least
        a quarter of the cache: each removal copies the cache once."""
        used = self.slot_mask.any(dim=0)  # [S]
        if used.numel() == 0 or bool(used[0]):
            return
        first_used = int(used.nonzero().min()) if used.any() else used.numel()
        if first_used < max(16, used.numel() // 4):
            return
        key_values = _filled_key_values(self.cache)
        if key_values:
            compat.replace_cache_key_values(self.cache, [(k[:, :, first_used:], v[:, :, first_used:]) for k, v in key_values])
        self.slot_mask = self.slot_mask[:, first_used:]

    def _crop_empty_tail(self) -> None:
        """Remove trailing slots that no row uses."""
        used = self.slot_mask.any(dim=0)  # [S]
        if used.all():
            return
        last_used = int(used.nonzero().max()) + 1 if used.any() else 0
        remove = self.slot_mask.shape[1] - last_used
        if remove > 0:
            self.cache.crop(-remove)
            self.slot_mask = self.slot_mask[:, :last_used]


def _filled_key_values(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values [B, H, S, D], or [] before the first forward filled them."""
    if not all(getattr(layer, "is_initialized", False) for layer in cache.layers):
        return []
    key_values = compat.cache_key_values(cache)
    return key_values if key_values and key_values[0][0].dim() == 4 else []


def _rows_at_width(
    key_values: list[tuple[torch.Tensor, torch.Tensor]], layer: int, part: int, rows: int, width: int, like: torch.Tensor
) -> torch.Tensor:
    """One side of a join at the joined width: its keys or values with holes before them, or all holes when empty."""
    if key_values:
        return _left_holes(key_values[layer][part], width)
    return like.new_zeros(rows, like.shape[1], width, like.shape[3])


def _left_holes(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, H, width, D] with zeros (masked holes) before its slots."""
    if tensor.shape[-2] == width:
        return tensor
    return torch.nn.functional.pad(tensor, (0, 0, width - tensor.shape[-2], 0))


def right_aligned(tensors: list[torch.Tensor], width: int) -> torch.Tensor:
    """Rows [1, H, P_b, D] stacked into [B, H, width, D], each at the right end (zeros before it)."""
    if all(t.shape[-2] == width for t in tensors):
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    out = tensors[0].new_zeros(len(tensors), tensors[0].shape[1], width, tensors[0].shape[-1])
    for row, tensor in enumerate(tensors):
        out[row : row + 1, :, width - tensor.shape[-2] :] = tensor
    return out


def _reads_strided_cache(model: torch.nn.Module, device: torch.device) -> bool:
    """True when every multi-token call over the cache goes to the row-stable CPU kernel, which reads
    K/V through their strides: views of preallocated storage then give the bits a concatenated
    cache gives. Other attention paths keep the contiguous concatenation they were checked with."""
    from quasar_hf.ops import attention_cpu
    from quasar_hf.ops.rowstable_attention import QUASAR_ATTENTION

    return (
        torch.device(device).type == "cpu"
        and compat.attn_implementation(model) == QUASAR_ATTENTION
        and getattr(model, "dtype", None) in (torch.float32, torch.bfloat16)
        and attention_cpu.is_available()
    )
