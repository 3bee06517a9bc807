"""Drafters: propose tokens for the verifier to check, behind one small interface.

A drafter sees each active row as a 1-D LongTensor of its real tokens (prompt without padding
+ tokens emitted so far) and returns a `Draft`. After verification the loop calls
`on_accept(num_accepted)` so stateful drafters (an assistant model's KV cache) roll back what
was rejected, and `select_rows(rows)` when finished rows leave the batch. A drafter that can serve
rows joining a running batch (the serving engine) also has `add_rows(prompts)`: new rows at the end.
New drafters register a factory in DRAFTER_FACTORIES; the verifier never changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .row_aligned_cache import RowAlignedCache
from .verify import sample_rows


@dataclass
class Draft:
    """tokens [B, k] (padded with 0 past a row's length), lengths [B], probs [B, k, V] or None (deterministic)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None = None


@dataclass
class DraftSetup:
    """What a drafter needs to know about this generation call."""

    do_sample: bool
    score_fn: Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]  # (row prefixes, logits [B, V]) -> scores
    generator: torch.Generator | None
    device: torch.device
    verify_width: int | None = None  # every verify step runs this many draft tokens (a static cache pads to it), else None


class Drafter(Protocol):
    """The drafter interface used by the speculative loop."""

    def start(self, prompts: list[torch.Tensor], setup: DraftSetup) -> None: ...

    def propose(self, sequences: list[torch.Tensor], max_tokens: list[int]) -> Draft: ...

    def on_accept(self, num_accepted: torch.Tensor) -> None: ...

    def select_rows(self, rows: torch.Tensor) -> None: ...


def pack_drafts(rows: list[torch.Tensor], device: torch.device) -> Draft:
    """Right-pad per-row draft lists into a Draft without probabilities."""
    k = max((len(r) for r in rows), default=0)
    tokens = torch.zeros(len(rows), k, dtype=torch.long, device=device)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = row
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
    return Draft(tokens=tokens, lengths=lengths)


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the text's last n tokens, propose what followed.

    Tries n = max_ngram_size down to min_ngram_size (longest match first) over prompt + generated
    tokens; a row with no match drafts nothing (its verify step is a plain decode step).
    """

    def __init__(self, num_draft_tokens: int = 5, max_ngram_size: int = 3, min_ngram_size: int = 1) -> None:
        self.num_draft_tokens = num_draft_tokens
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size
        self.device = torch.device("cpu")

    def start(self, prompts: list[torch.Tensor], setup: DraftSetup) -> None:
        self.device = setup.device

    def propose(self, sequences: list[torch.Tensor], max_tokens: list[int]) -> Draft:
        rows = [self.lookup(seq, min(self.num_draft_tokens, budget)) for seq, budget in zip(sequences, max_tokens)]
        return pack_drafts(rows, self.device)

    def lookup(self, sequence: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Continuation [<= num_tokens] of the latest earlier match of the longest matching suffix."""
        empty = sequence.new_empty(0)
        if num_tokens <= 0:
            return empty
        length = sequence.shape[0]
        for n in range(min(self.max_ngram_size, length - 1), self.min_ngram_size - 1, -1):
            windows = sequence[: length - 1].unfold(0, n, 1)  # [length - n, n]: every n-gram with a successor
            hits = (windows == sequence[length - n :]).all(dim=-1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return sequence[start : start + num_tokens]
        return empty

    def on_accept(self, num_accepted: torch.Tensor) -> None:
        pass

    def select_rows(self, rows: torch.Tensor) -> None:
        pass

    def add_rows(self, prompts: list[torch.Tensor]) -> None:
        pass


class NoDrafter(NgramDrafter):
    """Drafts nothing: a request prefilled alone before it joins a running batch, whose drafter serves it from then on."""

    def __init__(self) -> None:
        super().__init__(num_draft_tokens=0)


class AssistantDrafter:
    """A small causal LM (same tokenizer) drafting autoregressively with its own KV cache.

    Greedy drafts (argmax of its processed scores) when the verifier is greedy; sampled drafts
    with their probabilities q when the verifier samples. Rejected draft tokens are removed from
    its cache in `on_accept`.
    """

    def __init__(
        self, assistant_model: torch.nn.Module, num_draft_tokens: int = 5, verifier: torch.nn.Module | None = None
    ) -> None:
        if assistant_model is None:
            raise ValueError(
                "drafter='assistant' needs an assistant model: pass assistant_model=<a causal LM sharing the tokenizer>."
            )
        self.model = assistant_model
        # what calibration predicts for this drafter ({"acceptance", "draft_tokens", "predicted_speedup"}),
        # set by the self drafters (quasar_hf.self_draft.drafters); drafter="auto" starts its adaptive policy from it
        self.calibration_prediction: dict | None = None
        self.num_draft_tokens = num_draft_tokens
        # Drafts and their probabilities cover the verifier's vocabulary (None: the assistant's own).
        self.vocab_size = None if verifier is None else check_assistant_vocabulary(verifier, assistant_model)

    def start(self, prompts: list[torch.Tensor], setup: DraftSetup) -> None:
        self.setup = setup
        # Drafts need no bit-stability (q is whatever the drafter computed): one batched attention call.
        self.state = RowAlignedCache(self.model, len(prompts), setup.device)
        self.fed_drafts = torch.zeros(len(prompts), dtype=torch.long, device=setup.device)  # drafts in its cache

    @torch.no_grad()
    def propose(self, sequences: list[torch.Tensor], max_tokens: list[int]) -> Draft:
        budgets = [min(self.num_draft_tokens, m) for m in max_tokens]
        k = max(budgets, default=0)
        batch = len(sequences)
        if k == 0:
            return pack_drafts([sequences[0].new_empty(0)] * batch, self.setup.device)
        logits = self._ingest(sequences)  # [B, V]: next-token logits after each row's last token
        prefixes = list(sequences)
        tokens, probs = [], []
        for step in range(k):
            scores = self.setup.score_fn(prefixes, logits)  # [B, V]
            token, q = self._choose(scores)
            tokens.append(token)
            probs.append(q)
            prefixes = [torch.cat([p, t.view(1)]) for p, t in zip(prefixes, token)]
            if step + 1 < k:
                logits = self._fit_vocabulary(self.state.forward(token[:, None])[:, -1])
        self.fed_drafts = torch.full((batch,), k - 1, dtype=torch.long, device=self.setup.device)
        lengths = torch.tensor(budgets, dtype=torch.long, device=self.setup.device)
        draft_probs = torch.stack(probs, dim=1) if self.setup.do_sample else None
        return Draft(tokens=torch.stack(tokens, dim=1), lengths=lengths, probs=draft_probs)

    def _ingest(self, sequences: list[torch.Tensor]) -> torch.Tensor:
        """Feed each row's tokens not yet in the cache (right-padded chunk); return last-token logits [B, V]."""
        cached = self.state.valid_len.tolist()
        new = [seq[c:] for seq, c in zip(sequences, cached)]
        width = max(len(n) for n in new)
        chunk = torch.zeros(len(new), width, dtype=torch.long, device=self.setup.device)
        mask = torch.zeros_like(chunk)
        for b, tokens in enumerate(new):
            chunk[b, : len(tokens)] = tokens
            mask[b, : len(tokens)] = 1
        if self.state.slot_mask.shape[1] == 0 and len(new) > 1:  # first call with several rows: left-pad instead
            chunk, mask = _right_to_left(chunk, mask)
        logits = self.state.forward(chunk, mask)  # [B, width, V]
        if self.state.batch_size > 1:
            self.state.check_holes_supported()
        last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # index of each row's last real token
        return self._fit_vocabulary(logits[torch.arange(len(new)), last])

    def _fit_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [B, V_assistant] -> [B, V_verifier]: padding rows beyond it dropped, missing ones -inf."""
        if self.vocab_size is None or logits.shape[-1] == self.vocab_size:
            return logits
        if logits.shape[-1] > self.vocab_size:
            return logits[:, : self.vocab_size]
        return torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))

    def _choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.setup.do_sample:
            return scores.argmax(-1), None
        q = torch.softmax(scores, dim=-1)
        return sample_rows(q, self.setup.generator), q

    def on_accept(self, num_accepted: torch.Tensor) -> None:
        """Forget the fed draft tokens beyond the accepted ones."""
        rejected_in_cache = (self.fed_drafts - num_accepted).clamp(min=0)
        if bool(rejected_in_cache.any()):
            self.state.drop_last_tokens(rejected_in_cache)
        self.fed_drafts.zero_()

    def select_rows(self, rows: torch.Tensor) -> None:
        self.state.select_rows(rows)
        self.fed_drafts = self.fed_drafts[rows]

    def add_rows(self, prompts: list[torch.Tensor]) -> None:
        """New rows with nothing in this drafter's cache yet: their prompts are fed at their first draft."""
        self.state.add_empty_rows(len(prompts))
        self.fed_drafts = torch.cat([self.fed_drafts, self.fed_drafts.new_zeros(len(prompts))])


def _vocabulary_sizes(model: torch.nn.Module) -> tuple[int, int]:
    """(rows of the input embedding table, width of the logits) of a causal LM."""
    embedding = model.get_input_embeddings()
    read = getattr(embedding, "num_embeddings", None) or embedding.weight.shape[0]
    head = model.get_output_embeddings()
    emit = getattr(head, "out_features", None) if head is not None else None
    return int(read), int(emit or model.config.get_text_config().vocab_size)


def check_assistant_vocabulary(verifier: torch.nn.Module, assistant: torch.nn.Module) -> int:
    """Check before any forward that `assistant` can draft for `verifier`; return the verifier's vocabulary size.

    Only the models are known here, not their tokenizers, so the rule is on table sizes: the
    assistant must read every token id the verifier can emit (its embedding table has at least
    as many rows as the verifier's logits). A larger assistant table is fine (padding rows of the
    same tokenizer): its drafts are kept to the verifier's ids. An assistant with another
    tokenizer whose table is at least as large cannot be told apart by sizes; it only drafts
    badly (fewer accepted tokens); the output is still the verifier's.
    """
    _, verifier_emits = _vocabulary_sizes(verifier)
    assistant_reads, assistant_emits = _vocabulary_sizes(assistant)
    if assistant_reads < verifier_emits:
        raise ValueError(
            f"the assistant model's vocabulary is smaller than the verifier's: it embeds {assistant_reads} token ids "
            f"(logits {assistant_emits}), the verifier emits {verifier_emits}, so they do not share a tokenizer. "
            "Use an assistant trained with the verifier's tokenizer (a smaller model of the same family), "
            "or drafter='ngram'."
        )
    return verifier_emits


def _right_to_left(chunk: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move right padding to the left (prompts are left-padded, like plain batched generate)."""
    shift = (mask == 0).sum(-1)  # [B]
    index = (torch.arange(chunk.shape[1], device=chunk.device)[None, :] - shift[:, None]) % chunk.shape[1]
    return chunk.gather(1, index), mask.gather(1, index)


DrafterFactory = Callable[..., Drafter]


def _ngram_factory(verifier: torch.nn.Module, config) -> Drafter:
    return NgramDrafter(config.num_draft_tokens, config.max_ngram_size, config.min_ngram_size, **config.drafter_kwargs)


def _assistant_factory(verifier: torch.nn.Module, config) -> Drafter:
    return AssistantDrafter(config.assistant_model, config.num_draft_tokens, verifier=verifier, **config.drafter_kwargs)


DRAFTER_FACTORIES: dict[str, DrafterFactory] = {
    "ngram": _ngram_factory,
    "assistant": _assistant_factory,
}  # quasar_hf.hf registers "self" (the dual-precision model's own draft path)


def make_drafter(verifier: torch.nn.Module, config) -> Drafter:
    """Build the drafter named by `config.drafter` (or return a Drafter object passed as is)."""
    if not isinstance(config.drafter, str):
        return config.drafter
    factory = DRAFTER_FACTORIES.get(config.drafter)
    if factory is None:
        raise ValueError(f"Unknown drafter {config.drafter!r}; available: {sorted(DRAFTER_FACTORIES)}.")
    return factory(verifier, config)
