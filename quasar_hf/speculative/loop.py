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

from .drafters import Draft, Drafter, DraftSetup
from .row_aligned_cache import RowAlignedCache
from .row_rules import RowRules, accept, choose_first
from .row_scores import processed_scores, verified_scores
from .static_cache import StaticVerifierCache
from .stats import QuasarStats
from .token_uniforms import TokenUniforms


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
    """State of one call: per-row token lists and rules, the verifier cache, pending tokens, stats.

    `run()` decodes a whole `generate` call. The serving engine (engine.py) drives the same steps
    itself: `prefill()` one request alone, `join()` it to the running batch, `step()` every row."""

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
        joinable: bool = False,
    ) -> None:
        """`verifier` defaults to a RowAlignedCache; `draft_width` pads non-empty drafts to that many
        tokens (fixed step shapes for a static cache; the padding's logits are never read);
        `cached_prefix[b]`: the verifier already holds row b's first that many prompt tokens;
        `keep_row_cache(tokens, key_values)`: receives each row's keys and values as it finishes (a RowAlignedCache's);
        `joinable`: rows that may join later (the engine): `drafter` drafts greedily for every row, a sampled row
        chooses each token with its own uniforms (token_uniforms.py), finished rows are released."""
        self.model = model
        self.prepared = prepared
        self.drafter = drafter
        self.streamer = streamer
        self.generator = generator
        self.do_sample = bool(prepared.generation_config.do_sample)
        self.joinable = joinable
        self.device = prepared.input_ids.device
        self.rows = list(prepared.input_ids)  # per row [T + generated]: the input_ids plain generate would see
        self.pad_lengths = (prepared.attention_mask == 0).sum(-1).tolist()
        self.active = list(range(len(self.rows)))  # original indices of unfinished rows
        own = self.do_sample and joinable
        self.rules = [
            RowRules(
                processors,
                prepared.stopping_criteria,
                self.do_sample,
                generator,
                prepared.max_length,
                uniforms=TokenUniforms(generator) if own else None,
            )
            for processors in prepared.row_logits_processors
        ]
        self.shared_rules = True  # every row has the call's rules: the batch's processors apply to the batch
        self.pending = prepared.input_ids[:, -1]  # [B_active] each row's chosen token not yet fed (set by prefill)
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
        self.prefill()
        self._stream_columns()
        while self.active:
            self.step()
            self._stream_columns()
        if self.streamer is not None:
            self.streamer.end()
        self.stats.total_time_s = time.perf_counter() - started
        return self._padded_sequences(), self.stats

    def prefill(self) -> None:
        """Verifier forward over the prompts; choose each row's first token like plain generate."""
        started = time.perf_counter()
        ids, mask = self._uncached_prompts()
        logits = self.verifier.forward(ids, mask, last_only=True, prefill=True)[:, -1]
        if len(self.rows) > 1:
            self.verifier.check_holes_supported()
        scores = self._scores(self.active, self.rows, logits)  # [B, V]
        first = choose_first([self.rules[b] for b in self.active], scores)
        self.drafter.start([self.rows[b][self.pad_lengths[b] :] for b in self.active], self._draft_setup())
        self.stats.prefill_time_s += time.perf_counter() - started
        finished = [self._emit(b, first[i : i + 1], scores[i : i + 1])[1] for i, b in enumerate(self.active)]
        self.pending = self._drop_finished(first, finished)

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

    def step(self) -> None:
        """Draft, verify [pending + drafts] in one forward, emit accepted tokens, roll caches back."""
        started = time.perf_counter()
        draft = self._propose()
        drafted = time.perf_counter()
        k = draft.tokens.shape[1]
        chunk = torch.cat([self.pending[:, None], draft.tokens], dim=1)  # [B, k+1]
        if self.draft_width is not None and 0 < k < self.draft_width:  # [B, width+1]: one verify shape
            chunk = torch.cat([chunk, self.pending[:, None].expand(-1, self.draft_width - k)], dim=1)
        logits = self.verifier.forward(chunk)[:, : k + 1]  # [B, k+1, V] fp32
        self.stats.forward_time_s += time.perf_counter() - drafted
        self.stats.verifier_forwards += 1
        lengths = draft.lengths.tolist()
        scores = self._position_scores(draft, logits, lengths)  # [B, k+1, V]
        num_accepted, next_token = accept([self.rules[b] for b in self.active], draft, scores, lengths)
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
        self.stats.record_step(lengths, accepted_list, emitted)
        self.stats.draft_time_s += drafted - started
        self.stats.verify_time_s += time.perf_counter() - drafted
        self.pending = self._drop_finished(next_token, finished)

    def _propose(self) -> Draft:
        """Each active row's draft, up to its budget (tokens left, its draft limit)."""
        sequences = [self.rows[b][self.pad_lengths[b] :] for b in self.active]
        budgets = []
        for b in self.active:
            budget, limit = self.rules[b].max_length - len(self.rows[b]) - 1, self.rules[b].draft_limit
            budgets.append(budget if limit is None else min(budget, limit))
        draft = self.drafter.propose(sequences, budgets)
        if self.joinable and draft.probs is not None:
            raise RuntimeError("rows that join a running batch take deterministic drafts (the drafter runs greedy)")
        return draft

    def use_drafter(self, drafter: Drafter) -> None:
        """Draft with `drafter` from now on (a row prefilled alone becoming a batch: the batch's drafter)."""
        self.drafter = drafter
        drafter.start([self.rows[b][self.pad_lengths[b] :] for b in self.active], self._draft_setup())

    def join(self, other: SpeculativeRun) -> int:
        """Append another run's unfinished rows (a request prefilled alone) to this batch; the index its first row
        has here. Both runs must have been made for joining (`joinable`) on caches of one model."""
        if not (self.joinable and other.joinable and hasattr(self.drafter, "add_rows")):
            raise ValueError("only runs made for joining (joinable=True, a drafter with add_rows) can be joined")
        offset = len(self.rows)
        self.rows += other.rows
        self.pad_lengths += other.pad_lengths
        self.cached_prefix += other.cached_prefix
        self.rules += other.rules
        self.verifier.join(other.verifier)
        if other.active:
            self.drafter.add_rows([other.rows[b][other.pad_lengths[b] :] for b in other.active])
        self.active += [offset + b for b in other.active]
        self.pending = torch.cat([self.pending, other.pending])
        self.shared_rules = False
        return offset

    def _position_scores(self, draft: Draft, logits: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Processed scores at every position a row verified (up to its own draft length; past it, logits nobody
        reads), each with the prefix that position would have seen; for rows of several requests, at the positions
        their acceptance reads (row_scores.verified_scores)."""
        if all(len(self.rules[b].processors) == 0 for b in self.active):
            return logits
        if not self.shared_rules:  # rows of several requests: up to where each row's acceptance stops, rows stacked
            rules, sequences = [self.rules[b] for b in self.active], [self.rows[b] for b in self.active]
            return verified_scores(rules, sequences, draft, logits, lengths)
        columns = []
        for j in range(logits.shape[1]):
            needed = [i for i, n in enumerate(lengths) if n >= j]
            prefixes = [torch.cat([self.rows[self.active[i]], draft.tokens[i, :j]]) for i in needed]
            if len(needed) == len(lengths):
                columns.append(self._scores(self.active, prefixes, logits[:, j]))
                continue
            column = logits[:, j].clone()
            if needed:
                column[needed] = self._scores([self.active[i] for i in needed], prefixes, logits[needed, j])
            columns.append(column)
        return torch.stack(columns, dim=1)

    def _scores(self, rows: list[int], prefixes: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """Apply the logits processors to logits [B, V] given each row's prefix (1-D, padded prompt + tokens)."""
        if all(len(self.rules[b].processors) == 0 for b in rows):
            return logits
        if self.shared_rules and len(rows) == len(self.rows) and len({p.shape[0] for p in prefixes}) == 1:
            return self.prepared.logits_processor(torch.stack(prefixes), logits.clone())  # as plain generate calls it
        # Rows of different lengths, a subset of rows, or rows of several calls: each row its own processors.
        return processed_scores([self.rules[b].processors for b in rows], prefixes, logits)

    def _draft_scores(self, prefixes: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
        """Processed scores for the drafter, whose prefixes are its rows without their left padding."""
        padded = [torch.cat([self.rows[b][: self.pad_lengths[b]], p]) for b, p in zip(self.active, prefixes)]
        return self._scores(self.active, padded, logits)

    def _emit(self, row: int, tokens: torch.Tensor, scores: torch.Tensor) -> tuple[int, bool]:
        """Append tokens to a row one at a time until a stopping criterion fires; stream them."""
        count, done = 0, False
        for j in range(tokens.shape[0]):
            self.rows[row] = torch.cat([self.rows[row], tokens[j : j + 1]])
            count += 1
            if bool(self.rules[row].stopping(self.rows[row][None], scores[j : j + 1]).any()):
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
            b = self.active[i]
            if done and self.keep_row_cache is not None and _holds_row_caches(self.verifier):
                key_values = self.verifier.row_key_values(i)
                fed = key_values[0][0].shape[-2]  # the row's tokens whose keys and values the cache holds
                self.keep_row_cache(self.rows[b][self.pad_lengths[b] : self.pad_lengths[b] + fed].tolist(), key_values)
            if done and hasattr(self.streamer, "end_row"):
                self.streamer.end_row(b)
        keep = [i for i, done in enumerate(finished) if not done]
        gone = {self.active[i] for i, done in enumerate(finished) if done}
        self.active = [self.active[i] for i in keep]
        if self.joinable:  # rows of a long-lived batch: their tokens were streamed, free them
            for b in gone:
                self.rows[b] = self.rows[b][:0]
        if not keep:
            return pending[:0]
        keep_index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.verifier.select_rows(keep_index, max(self.rules[b].max_length - len(self.rows[b]) for b in self.active))
        self.drafter.select_rows(keep_index)
        return pending[keep_index]

    def _draft_setup(self) -> DraftSetup:
        return DraftSetup(  # rows that may join draft greedily: a sampled one chooses with its own uniforms
            do_sample=self.do_sample and not self.joinable,
            score_fn=self._draft_scores,
            generator=None if self.joinable else self.generator,
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
    """A cache whose rows' keys and values can seed a later call: full-attention layers of a RowAlignedCache, or of a
    StaticVerifierCache that outlives its call (the serving engine's)."""
    if isinstance(verifier, StaticVerifierCache):
        return verifier.buffers is not None and not verifier.has_sliding_layers
    return isinstance(verifier, RowAlignedCache) and not verifier.has_sliding_layers
