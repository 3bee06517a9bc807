"""Batched calls: requests whose options the step engine does not implement decode together, to the end.

The scheduler (batcher.py) runs them once no row is running: the held requests that agree in their settings
(`batch_key`) make one left-padded `generate(quasar=...)` call, streaming every row to its request; options the
speculative loop declines run as plain `generate`, one request at a time.
"""

from __future__ import annotations

import json
import uuid

import torch
from transformers import GenerationConfig

from quasar_hf import compat

from .batch_request import BatchRequest, RequestRows
from .engine import MIN_REUSED_TOKENS
from .left_padding import left_padded
from .prompt_cache import PromptCache
from .request_config import request_quasar_config
from .stats import QuasarStats


def batch_key(request: BatchRequest) -> str:
    """Requests with equal keys decode in one batch: greedy ones whose settings differ only in max_new_tokens
    (a sampled request's key is its own: its randomness depends on nothing else served)."""
    if request.key is None:
        config = request.generation_config
        ignored = ("max_new_tokens", "max_length", "transformers_version")
        settings = {k: v for k, v in config.to_dict().items() if k not in ignored}
        request.key = f"sampled-{uuid.uuid4()}" if config.do_sample else json.dumps(settings, sort_keys=True, default=repr)
    return request.key


def decode_batch(
    model: torch.nn.Module, batch: list[BatchRequest], quasar: dict | None = None, prompt_cache: PromptCache | None = None
) -> QuasarStats | None:
    """One batched speculative call for `batch` (requests of one batch key), streaming every row; its counters.
    On the dynamic cache, rows continue from `prompt_cache`'s longest prefix of their prompts (when every row
    has one) and leave their own keys and values there."""
    from .strategy import generate_with_quasar

    config = batch[0].runnable_config()
    config.max_new_tokens = max(int(r.generation_config.max_new_tokens or 0) for r in batch)
    quasar_config = request_quasar_config(model, config, quasar, batch[0].tokenizer)
    if quasar_config is None:  # options the loop does not implement: plain generate, one request at a time
        for request in batch:
            _decode_plainly(model, request)
        return None
    config.return_dict_in_generate = True
    input_ids, attention_mask = left_padded([r.input_ids for r in batch], pad_token_id(model, config), compat.input_device(model))
    prefixes, keep = None, None
    # Cached prefixes only when every row has one: a row without continues from nothing, which is a plain
    # prefill when alone, and its bits must be the ones it gets alone.
    if prompt_cache is not None and quasar_config.cache_implementation != "static":
        hits = [prompt_cache.longest_prefix(r.input_ids, MIN_REUSED_TOKENS) for r in batch]
        if all(hit is not None for hit in hits):  # every row continues from the cache, or none does
            prefixes = [hit.layers for hit in hits]
            for request, hit in zip(batch, hits):
                request.reused_tokens = hit.tokens
        keep = prompt_cache.store
    with torch.no_grad():
        out = generate_with_quasar(
            model,
            input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            streamer=RequestRows(dict(enumerate(batch))),
            quasar=quasar_config,
            quasar_generator=batch[0].generator,
            tokenizer=batch[0].tokenizer,
            quasar_prefixes=prefixes,
            quasar_keep_row_cache=keep,
        )
    return getattr(out, "quasar_stats", None)


def _decode_plainly(model: torch.nn.Module, request: BatchRequest) -> None:
    """Plain generate of one request (its options are ones the speculative loop does not implement)."""
    ids = torch.tensor([request.input_ids], dtype=torch.long, device=compat.input_device(model))
    with torch.no_grad():
        out = model.generate(ids, generation_config=request.runnable_config(), tokenizer=request.tokenizer, quasar=False)
    RequestRows({0: request}).put_row(0, out[0, ids.shape[1] :].tolist())


def pad_token_id(model: torch.nn.Module, config: GenerationConfig) -> int:
    """The id left padding uses (never read: the mask hides it), an in-vocabulary one."""
    for value in (config.pad_token_id, config.eos_token_id, model.generation_config.pad_token_id):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0
