"""The speculative decode loop: draft, verify in one forward, accept, roll back the KV cache.

`SpeculativeRun` runs on any causal LM: a Quasar W8A8 model or a BF16/FP32 one (the like-for-like
baseline "speculative decoding with BF16 verification"); `strategy.py` feeds it what `generate`
prepared, and `speculative_generate` is the function form of `generate(..., quasar=...)`. Tokens are chosen exactly as plain `generate` would choose them: the same
processors on FP32 logits with the prefix each position would have seen, argmax when greedy,
exact speculative sampling otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .drafters import Drafter, DraftSetup
from .kv_state import RowAlignedCache
from .static_cache import StaticVerifierCache
from .stats import QuasarStats
from .verify import greedy_accept, speculative_sample_accept


@dataclass
class QuasarGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the speculative counters."""

    quasar_stats: QuasarStats | None = None


class RowStreamer(Protocol):
    """A streamer for a batch: `put_row(row, token_ids)` gets each row's new tokens as they are accepted
    (`row` indexes the batch as given) and returns True to stop that row there (a cancelled request, a row's
    own token budget); `end_row(row)` when that row decodes no more (optional); `end()` when the call is
    over. `put` receives the prompt once, from generate."""

    def put(self, value: torch.Tensor) -> None: ...

    def put_row(self, row: int, token_ids: list[int]) -> bool: ...

    def end(self) -> None: ...


RowCacheSink = Callable[[list[int], list[tuple[torch.Tensor, torch.Tensor]]], None]  # (tokens, each layer's K, V)


@dataclass
class PreparedGeneration:
    """Everything the loop needs, as `generate` prepared it for this call."""

    input_ids: torch.Tensor  # [B, T] left-padded prompts
    attention_mask: torch.Tensor  # [B, T] long, 1 = real token
    generation_config: GenerationConfig
    logits_processor: LogitsProcessorList  # for the whole batch [B, ...]
    row_logits_processors: list[LogitsProcessorList]  # one per row, for calls on a single row [1, ...]
    stopping_criteria: StoppingCriteriaList
    pad_token_id: int | None
    max_length: int


class SpeculativeRun:
    """State of one call: per-row token lists, the verifier cache, pending tokens, stats."""

    def __init__(
        self,
        model,
        prepared: PreparedGeneration,
        drafter: Drafter,
        streamer,
        generator,
        verify_kwargs: dict | None = None,
        verifier: RowAlignedCache | StaticVerifierCache | None = None,
        draft_width: int | None = None,
        cached_prefix: list[int] | None = None,
        keep_row_cache: RowCacheSink | None = None,
    ) -> None:
        """`verifier` defaults to a RowAlignedCache; `draft_width` pads non-empty drafts to that many
        tokens (fixed step shapes for a static cache; the padding's logits are never read);
        `cached_prefix[b]`: the verifier already holds row b's first that many prompt tokens;
        `keep_row_cache(tokens, key_values)`: receives each row's keys and values as it finishes (a RowAlignedCache's)."""
        self.model = model
        self.prepared = prepared
        self.drafter = drafter
        self.streamer = streamer
        self.generator = generator
        self.do_sample = bool(prepared.generation_config.do_sample)
        self.device = prepared.input_ids.device
        self.rows = list(prepared.input_ids)  # per row [T + generated]: the input_ids plain generate would see
        self.pad_lengths = (prepared.attention_mask == 0).sum(-1).tolist()
        self.active = list(range(len(self.rows)))  # original indices of unfinished rows
        self.cached_prefix = cached_prefix or [0] * len(self.rows)
        self.keep_row_cache = keep_row_cache
        self.stats = QuasarStats(prefill_tokens=int(prepared.attention_mask.sum()) - sum(self.cached_prefix))
        self.verifier = verifier or RowAlignedCache(model, len(self.rows), self.device, verify_kwargs)
        self.draft_width = draft_width
        # A streamer without put_row over a batch gets what plain generate gives it: one [B] column per position.
        self.column_streamer = streamer is not None and not hasattr(streamer, "put_row") and len(self.rows) > 1
        self.streamed_to = prepared.input_ids.shape[1]  # positions that streamer has had

    def run(self) -> tuple[torch.Tensor, QuasarStats]:
        started = time.perf_counter()  # the prompt was streamed by generate
        pending = self._prefill()
        self._stream_columns()
        while self.active:
            pending = self._verify_step(pending)
            self._stream_columns()
        if self.streamer is not None:
            self.streamer.end()
        self.stats.total_time_s = time.perf_counter() - started
        return self._padded_sequences(), self.stats

    def _prefill(self) -> torch.Tensor:
        """Verifier forward over the prompts; choose each row's first token like plain generate."""
        started = time.perf_counter()
        ids, mask = self._uncached_prompts()
        logits = self.verifier.forward(ids, mask, last_only=True)[:, -1]
        if len(self.rows) > 1:
            self.verifier.check_holes_supported()
        scores = self._scores(self.active, self.rows, logits)  # [B, V]
        first = scores.argmax(-1) if not self.do_sample else self._sample(scores)
        self.drafter.start([r[p:] for r, p in zip(self.rows, self.pad_lengths)], self._draft_setup())
        self.stats.prefill_time_s += time.perf_counter() - started
        finished = [self._emit(b, first[i : i + 1], scores[i : i + 1])[1] for i, b in enumerate(self.active)]
        return self._drop_finished(first, finished)

    def _uncached_prompts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids and mask [B, W] of the prompt tokens past each row's cached prefix, left-padded."""
        if not any(self.cached_prefix):
            return self.prepared.input_ids, self.prepared.attention_mask
        rest = [row[pad + cached :] for row, pad, cached in zip(self.rows, self.pad_lengths, self.cached_prefix)]
        width = max(part.shape[0] for part in rest)
        pad = self.prepared.pad_token_id or 0
        ids = torch.full((len(rest), width), pad, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(rest), width), dtype=torch.long, device=self.device)
        for b, part in enumerate(rest):
            ids[b, width - part.shape[0] :] = part
            mask[b, width - part.shape[0] :] = 1
        return ids, mask

    def _verify_step(self, pending: torch.Tensor) -> torch.Tensor:
        """Draft, verify [pending + drafts] in one forward, emit accepted tokens, roll caches back."""
        started = time.perf_counter()
        real_rows = [self.rows[b][self.pad_lengths[b] :] for b in self.active]
        budgets = [self.prepared.max_length - len(self.rows[b]) - 1 for b in self.active]
        draft = self.drafter.propose(real_rows, budgets)
        drafted = time.perf_counter()
        k = draft.tokens.shape[1]
        chunk = torch.cat([pending[:, None], draft.tokens], dim=1)  # [B, k+1]
        if self.draft_width is not None and 0 < k < self.draft_width:  # [B, width+1]: one verify shape
            chunk = torch.cat([chunk, pending[:, None].expand(-1, self.draft_width - k)], dim=1)
        logits = self.verifier.forward(chunk)[:, : k + 1]  # [B, k+1, V] fp32
        self.stats.forward_time_s += time.perf_counter() - drafted
        self.stats.verifier_forwards += 1
        scores = self._position_scores(draft.tokens, logits)  # [B, k+1, V]
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1)
            num_accepted, next_token = speculative_sample_accept(draft.tokens, draft.probs, probs, self.generator, draft.lengths)
        else:
            num_accepted, next_token = greedy_accept(draft.tokens, scores, draft.lengths)
        self.verifier.keep_accepted(num_accepted + 1, chunk.shape[1])  # pending token + accepted drafts
        self.drafter.on_accept(num_accepted)
        accepted_list = num_accepted.tolist()
        emitted, finished = [], []
        for i, b in enumerate(self.active):
            n = accepted_list[i]
            tokens = torch.cat([draft.tokens[i, :n], next_token[i : i + 1]])
            count, done = self._emit(b, tokens, scores[i, : n + 1])
            emitted.append(count)
            finished.append(done)
        self.stats.record_step(draft.lengths.tolist(), accepted_list, emitted)
        self.stats.draft_time_s += drafted - started
        self.stats.verify_time_s += time.perf_counter() - drafted
        return self._drop_finished(next_token, finished)

    def _position_scores(self, draft_tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Processed scores at every verified position, each with the prefix that position would have seen."""
        if len(self.prepared.logits_processor) == 0:
            return logits
        columns = []
        for j in range(logits.shape[1]):
            prefixes = [torch.cat([self.rows[b], draft_tokens[i, :j]]) for i, b in enumerate(self.active)]
            columns.append(self._scores(self.active, prefixes, logits[:, j]))
        return torch.stack(columns, dim=1)

    def _scores(self, rows: list[int], prefixes: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """Apply the logits processors to logits [B, V] given each row's prefix (1-D, padded prompt + tokens)."""
        processors = self.prepared.logits_processor
        if len(processors) == 0:
            return logits
        if len(rows) == len(self.rows) and len({p.shape[0] for p in prefixes}) == 1:
            return processors(torch.stack(prefixes), logits.clone())  # the whole batch, as plain generate calls it
        # Rows of different lengths (or a subset of rows): one call per row, with that row's processors.
        per_row = self.prepared.row_logits_processors
        return torch.cat([per_row[b](p[None], logits[i : i + 1].clone()) for i, (b, p) in enumerate(zip(rows, prefixes))])

    def _draft_scores(self, prefixes: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """Processed scores for a drafter, whose prefixes are the active rows without their left padding."""
        padded = [torch.cat([self.rows[b][: self.pad_lengths[b]], p]) for b, p in zip(self.active, prefixes)]
        return self._scores(self.active, padded, logits)

    def _sample(self, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)

    def _emit(self, row: int, tokens: torch.Tensor, scores: torch.Tensor) -> tuple[int, bool]:
        """Append tokens to a row one at a time until a stopping criterion fires; stream them."""
        count, done = 0, False
        for j in range(tokens.shape[0]):
            self.rows[row] = torch.cat([self.rows[row], tokens[j : j + 1]])
            count += 1
            if bool(self.prepared.stopping_criteria(self.rows[row][None], scores[j : j + 1]).any()):
                done = True
                break
        if self.streamer is not None and hasattr(self.streamer, "put_row"):  # a RowStreamer: it may stop the row
            done = bool(self.streamer.put_row(row, tokens[:count].tolist())) or done
        elif self.streamer is not None and not self.column_streamer:
            self.streamer.put(tokens[:count].cpu())
        return count, done

    def _stream_columns(self) -> None:
        """For a column streamer: put the [B] tensor of each position every unfinished row has reached (a finished
        row's pad_token_id after its end, as plain generate pads it); all of them once every row is done."""
        if not self.column_streamer:
            return
        lengths = [row.shape[0] for row in self.rows]
        ready = min(lengths[b] for b in self.active) if self.active else max(lengths)
        pad = self.prepared.pad_token_id
        for position in range(self.streamed_to, ready):
            column = [int(row[position]) if position < row.shape[0] else (0 if pad is None else pad) for row in self.rows]
            self.streamer.put(torch.tensor(column, dtype=torch.long))
        self.streamed_to = max(self.streamed_to, ready)

    def _drop_finished(self, pending: torch.Tensor, finished: list[bool]) -> torch.Tensor:
        """Remove finished rows from the batch, the verifier cache and the drafter."""
        if not any(finished):
            return pending
        for i, done in enumerate(finished):
            if done and self.keep_row_cache is not None and _holds_row_caches(self.verifier):
                b, fed = self.active[i], int(self.verifier.valid_len[i])
                self.keep_row_cache(
                    self.rows[b][self.pad_lengths[b] : self.pad_lengths[b] + fed].tolist(), self.verifier.row_key_values(i)
                )
            if done and hasattr(self.streamer, "end_row"):
                self.streamer.end_row(self.active[i])
        keep = [i for i, done in enumerate(finished) if not done]
        self.active = [self.active[i] for i in keep]
        if not keep:
            return pending[:0]
        keep_index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.verifier.select_rows(keep_index, max(self.prepared.max_length - len(self.rows[b]) for b in self.active))
        self.drafter.select_rows(keep_index)
        return pending[keep_index]

    def _draft_setup(self) -> DraftSetup:
        return DraftSetup(
            do_sample=self.do_sample,
            score_fn=self._draft_scores,
            generator=self.generator,
            device=self.device,
            verify_width=self.draft_width,
        )

    def _padded_sequences(self) -> torch.Tensor:
        """[B, longest] like plain generate: rows that stopped early are right-padded with pad_token_id."""
        longest = max(r.shape[0] for r in self.rows)
        pad = self.prepared.pad_token_id
        if pad is None and any(r.shape[0] != longest for r in self.rows):
            raise ValueError("Rows finished at different lengths but no pad_token_id is set; pass pad_token_id=... to generate.")
        out = torch.full((len(self.rows), longest), 0 if pad is None else pad, dtype=torch.long, device=self.device)
        for b, r in enumerate(self.rows):
            out[b, : r.shape[0]] = r
        return out


def _holds_row_caches(verifier: object) -> bool:
    """A RowAlignedCache whose rows' keys and values can seed a later call (full-attention layers only)."""
    return isinstance(verifier, RowAlignedCache) and not verifier.has_sliding_layers
