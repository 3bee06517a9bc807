"""Quasar decoding as a Transformers custom generation strategy.

`model.generate(ids, custom_generate=quasar_hf.generate, quasar=...)` runs `generate` below as the
decoding method: Transformers merges the generation config, prepares the inputs, builds the
logits processors and stopping criteria, then hands them over; the speculative loop uses exactly
those. Works on any causal LM (a Quasar W8A8 model, or a BF16 one as the like-for-like baseline).

Transformers gives a callable strategy neither the `streamer` nor the `tokenizer` (which
`stop_strings` needs). `generate_with_quasar` is the full entry point that keeps both: it takes
`generate`'s own arguments, turns stop strings into a stopping criterion, and calls Transformers'
`generate` with a strategy that carries the streamer. `model.generate(..., quasar=True)` on a
Quasar model, `quasar_hf.speculative_generate` and the Hub folder `hub/quasar-generate` all go
through it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
)

from quasar_hf import compat

from .call_rules import CACHE_NAMES, as_long_ids, check_call, check_prepared, generate_arguments
from .compiled_steps import batch_bucket, call_cache_slots, compiled_steps_for
from .config import QuasarGenerationConfig
from .drafters import make_drafter
from .loop import PreparedGeneration, QuasarGenerateOutput, RowCacheSink, SpeculativeRun
from .prompt_cache import KeyValues
from .row_aligned_cache import RowAlignedCache
from .static_buffers import CompiledBuffers, FreshBuffers
from .static_cache import StaticCacheBuffer, StaticVerifierCache, static_cache_slots
from .verify_attention import verification_attention


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: Any = None,
    quasar: QuasarGenerationConfig | dict | bool = True,
    quasar_generator: torch.Generator | None = None,
    **model_kwargs: Any,
) -> torch.Tensor | QuasarGenerateOutput:
    """The decoding method for `model.generate(ids, custom_generate=quasar_hf.generate, quasar=...)`.

    `quasar` chooses the drafter (True | dict | QuasarGenerationConfig); `quasar_generator` seeds
    acceptance and sampling. Everything else arrives prepared by `generate` (the streamer, when
    given, has already received the prompt).
    """
    config = QuasarGenerationConfig.from_value(True if quasar is None else quasar)
    reason = check_prepared(model, input_ids, generation_config, model_kwargs, synced_gpus=synced_gpus, quasar=config)
    if reason is not None:
        raise ValueError(reason)
    return run_prepared(
        model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs, config, streamer, quasar_generator
    )


def run_prepared(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    model_kwargs: dict,
    quasar_config: QuasarGenerationConfig,
    streamer: Any = None,
    generator: torch.Generator | None = None,
    prefixes: list[KeyValues] | None = None,
    keep_row_cache: RowCacheSink | None = None,
    admit: bool = False,
) -> torch.Tensor | QuasarGenerateOutput | SpeculativeRun:
    """Run the speculative loop on what `generate` prepared for this call; `prefixes[b]`: keys and values of
    row b's first prompt tokens, computed earlier (a prompt cache's); `keep_row_cache`: see SpeculativeRun.
    `admit`: prefill only and return the run, made to join a running batch (the serving engine, engine.py).
    The call's rules were checked before (call_rules.py: check_call, or check_prepared in `generate`)."""
    input_ids = as_long_ids(input_ids)
    attention_mask = model_kwargs.get("attention_mask")
    if generation_config.cache_implementation == "static":  # generate's own (empty) StaticCache: the loop sizes its own
        quasar_config = dataclasses.replace(quasar_config, cache_implementation="static")
        model_kwargs = {k: v for k, v in model_kwargs.items() if k not in CACHE_NAMES}
    batch_size = input_ids.shape[0]
    given = cached_prefix(model_kwargs)
    prefixes = [given] if given is not None else prefixes
    if prefixes is not None and len(prefixes) != batch_size:
        raise ValueError("cached prefixes need one prefix per row")
    if attention_mask is None:  # generate drops an all-ones mask
        attention_mask = torch.ones_like(input_ids)
    prepared = PreparedGeneration(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        generation_config=generation_config,
        logits_processor=logits_processor,
        row_logits_processors=row_processors(logits_processor, batch_size),
        stopping_criteria=stopping_criteria,
        pad_token_id=compat.pad_token_id(generation_config),
        max_length=int(generation_config.max_length),
    )
    drafter = make_drafter(model, quasar_config)
    with (
        verification_attention(model, quasar_config.rowstable_attention) as verify_kwargs,
        verifier_cache(model, prepared, quasar_config, verify_kwargs, hold=admit) as (verifier, draft_width),
    ):
        lengths = None
        if prefixes is not None:  # rows that continue from keys and values computed earlier
            verifier = verifier or RowAlignedCache(model, batch_size, input_ids.device, verify_kwargs)
            verifier.seed(prefixes)
            lengths = [prefix[0][0].shape[-2] for prefix in prefixes]
        if admit:
            verifier = verifier or RowAlignedCache(model, batch_size, input_ids.device, verify_kwargs)
        run = SpeculativeRun(
            model,
            prepared,
            drafter,
            streamer,
            generator,
            verify_kwargs,
            verifier,
            draft_width,
            lengths,
            keep_row_cache,
            joinable=admit,
        )
        if admit:
            run.prefill()
            return run
        sequences, stats = run.run()
    if generation_config.return_dict_in_generate:
        # one row on a dynamic cache: the cache holds exactly its tokens but the last, as plain generate's does
        cache = run.verifier.cache if batch_size == 1 and isinstance(run.verifier, RowAlignedCache) else None
        return QuasarGenerateOutput(sequences=sequences, quasar_stats=stats, past_key_values=cache)
    return sequences


@contextlib.contextmanager
def verifier_cache(
    model: torch.nn.Module,
    prepared: PreparedGeneration,
    config: QuasarGenerationConfig,
    verify_kwargs: dict,
    hold: bool = False,
) -> Iterator[tuple[StaticVerifierCache | None, int | None]]:
    """Within the block, the static verifier cache and the padded draft width when the config asks for one,
    else (None, None): the loop then keeps a RowAlignedCache. With compile, the cache's batch and size are
    bucketed and its steps run the model's compiled step for that shape (speculative/compiled_steps.py),
    compiled with the CompileConfig given (quasar's, else generate's `compile_config`, else
    `compat.default_compile_config`): calls of the same shapes and settings share its graphs, and its
    KV cache is one an earlier call of that shape gave back (cleared), not a new allocation. `hold`: the cache
    outlives the call (rows that join the serving engine's batch): it takes its own buffers (static_buffers.py),
    sized like compiled calls whether compiled or not, and gives them back itself (`release`)."""
    if config.cache_implementation != "static":
        yield None, None
        return
    width = max(config.num_draft_tokens, 1)
    batch_size, device = prepared.input_ids.shape[0], prepared.input_ids.device
    tokens = prepared.max_length + width + 1
    if hold:
        yield held_static_cache(model, prepared, config, verify_kwargs, width), width
        return
    if not config.compile:
        yield StaticVerifierCache(model, batch_size, device, static_cache_slots(tokens), None, verify_kwargs), width
        return
    compile_config = step_compile_config(config, prepared)
    rows, slots = batch_bucket(batch_size), call_cache_slots(model, prepared.max_length, config.num_draft_tokens)
    table = compiled_steps_for(model, compile_config)
    step = table.step_for(rows, slots)
    widths = {1, width + 1} if config.num_draft_tokens else {1}
    with contextlib.ExitStack() as caches:

        def shrink(unfinished: int, allocated: int) -> tuple[int, Any, StaticCacheBuffer] | None:
            """A smaller batch's steps and cache for the unfinished rows, where its steps have run (no compile)."""
            smaller = batch_bucket(unfinished)
            if smaller >= allocated or not table.ready(smaller, slots, widths):
                return None
            table.shrinks += 1
            kv = caches.enter_context(table.kv_cache(smaller, slots, lambda: StaticCacheBuffer.fresh(model, slots)))
            return smaller, table.step_for(smaller, slots), kv

        kv = caches.enter_context(table.kv_cache(rows, slots, lambda: StaticCacheBuffer.fresh(model, slots)))
        yield StaticVerifierCache(model, rows, device, slots, step, verify_kwargs, batch_size, kv, shrink), width


def step_compile_config(config: QuasarGenerationConfig, prepared: PreparedGeneration) -> Any:
    """The CompileConfig of compiled steps: quasar's, else generate's `compile_config`, else the default."""
    compile_config = config.compile if not isinstance(config.compile, bool) else None
    compile_config = compile_config or prepared.generation_config.compile_config  # generate(compile_config=...)
    return compile_config or compat.default_compile_config(prepared.input_ids.device)


def static_batch_slots(model: torch.nn.Module, max_length: int, config: QuasarGenerationConfig) -> int:
    """Cache slots of a held static cache for rows of up to `max_length` tokens: those of a compiled call, so that
    every request under the compiled size shares one batch."""
    return call_cache_slots(model, max_length, config.num_draft_tokens)


def held_static_cache(
    model: torch.nn.Module, prepared: PreparedGeneration, config: QuasarGenerationConfig, verify_kwargs: dict, width: int
) -> StaticVerifierCache:
    """A static verifier cache for the call's rows that takes its own buffers (verifier_cache's `hold`). Compiled, it
    takes the smallest warm cache size that holds the rows (a server warmed for --max-model-len serves its shorter
    requests there: no compile inside a request), else the size a compiled call of this length takes."""
    slots = static_batch_slots(model, prepared.max_length, config)
    batch_size = prepared.input_ids.shape[0]
    rows = batch_bucket(batch_size)
    if config.compile:
        table = compiled_steps_for(model, step_compile_config(config, prepared))
        widths = {1, width + 1} if config.num_draft_tokens else {1}
        slots = table.warm_slots(rows, slots, widths) or slots
        buffers = CompiledBuffers(model, table, slots, widths)
    else:
        buffers = FreshBuffers(model, slots)
    step, kv = buffers.take(rows)
    return StaticVerifierCache(
        model, rows, prepared.input_ids.device, slots, step, verify_kwargs, batch_size, kv, buffers=buffers
    )


def row_processors(processors: LogitsProcessorList, batch_size: int) -> list[LogitsProcessorList]:
    """One processor list per row, for calls on a single row [1, ...].

    Repetition penalty holds per-row state (the padding length to skip in each row); its row view
    keeps that row's entry. Every other processor is shared (it holds no per-row state).
    """
    if batch_size == 1:
        return [processors]
    return [LogitsProcessorList([_row_view(p, row, batch_size) for p in processors]) for row in range(batch_size)]


def _row_view(processor: Any, row: int, batch_size: int) -> Any:
    ignore = getattr(processor, "prompt_ignore_length", None)
    if isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(ignore, torch.Tensor):
        if ignore.dim() == 1 and ignore.shape[0] == batch_size:
            view = copy.copy(processor)
            view.prompt_ignore_length = ignore[row : row + 1]
            return view
    return processor


def cached_prefix(model_kwargs: dict) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The keys and values of a filled DynamicCache passed in (`past_key_values` of an earlier turn, one row, which
    call_rules.py allowed): the loop continues from it as plain generate does, prefilling only the tokens past it.
    None when none is passed, or an empty one."""
    for name in CACHE_NAMES:
        cache = model_kwargs.get(name)
        if cache is not None and cache.get_seq_length() > 0:
            return compat.cache_key_values(cache)
    return None


@torch.no_grad()
def generate_with_quasar(
    model: torch.nn.Module,
    *args: Any,
    quasar: QuasarGenerationConfig | dict | bool | None = True,
    quasar_generator: torch.Generator | None = None,
    quasar_prefixes: list[KeyValues] | None = None,
    quasar_keep_row_cache: RowCacheSink | None = None,
    quasar_admit: bool = False,
    **kwargs: Any,
) -> torch.Tensor | QuasarGenerateOutput | SpeculativeRun:
    """Quasar generation with `generate`'s own arguments (positional ones in plain generate's order; `tokenizer=`
    for stop strings), streamer and stop strings kept; a call the loop cannot run raises ValueError naming the
    option and the fix (call_rules.check_call).

    `assistant_model` drafts for the speculative loop (drafter="assistant"); `quasar` chooses the
    drafter and its settings; `quasar_generator` seeds acceptance and sampling; `quasar_prefixes` and
    `quasar_keep_row_cache` continue rows from a prompt cache and fill it, `quasar_admit` returns the prefilled run
    (run_prepared).
    """
    config = QuasarGenerationConfig.from_value(True if quasar is None else quasar)
    reason = check_call(model, args, {**kwargs, "quasar": config})
    if reason is not None:
        raise ValueError(reason)
    arguments = generate_arguments(args, kwargs)
    assistant_model = arguments.pop("assistant_model", None)
    if assistant_model is not None:
        drafter = "assistant" if config.drafter == "ngram" else config.drafter
        config = QuasarGenerationConfig(**{**config.__dict__, "assistant_model": assistant_model, "drafter": drafter})
    for name in ("inputs", "input_ids"):
        if name in arguments:
            arguments[name] = as_long_ids(arguments[name])
    streamer = arguments.get("streamer")  # generate streams the prompt; the loop streams the new tokens
    arguments["generation_config"], arguments["stopping_criteria"] = _stop_strings_as_criterion(
        arguments.get("generation_config"), arguments.get("stopping_criteria"), arguments.pop("tokenizer", None), arguments
    )

    def quasar_decoding(
        model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, **model_kwargs
    ):
        return run_prepared(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            model_kwargs,
            config,
            streamer,
            quasar_generator,
            quasar_prefixes,
            quasar_keep_row_cache,
            quasar_admit,
        )

    return type(model).generate(model, **{**arguments, "custom_generate": quasar_decoding})


def _stop_strings_as_criterion(
    generation_config: GenerationConfig | None, stopping_criteria: StoppingCriteriaList | None, tokenizer: Any, kwargs: dict
) -> tuple[GenerationConfig | None, StoppingCriteriaList | None]:
    """Build the StopStringCriteria plain generate would build (generate withholds the tokenizer from strategies);
    call_rules.py refused stop strings from the model's generation config and stop strings without a tokenizer."""
    stop_strings = kwargs.pop("stop_strings", None)
    if generation_config is not None and generation_config.stop_strings is not None:
        if stop_strings is None:
            stop_strings = generation_config.stop_strings
        generation_config = copy.deepcopy(generation_config)
        generation_config.stop_strings = None
    if stop_strings is None:
        return generation_config, stopping_criteria
    criterion = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
    return generation_config, StoppingCriteriaList([*(stopping_criteria or []), criterion])


def speculative_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    generation_config: GenerationConfig | None = None,
    quasar_config: QuasarGenerationConfig | dict | bool | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    streamer: Any = None,
    tokenizer: Any = None,
    generator: torch.Generator | None = None,
    **generate_kwargs: Any,
) -> torch.Tensor | QuasarGenerateOutput:
    """Speculative generation with `model` as the verifier; returns what `model.generate` returns.

    input_ids [B, T] (left-padded when B > 1, with attention_mask); generation options go in
    `generation_config` and/or keyword arguments exactly as for `generate` (max_new_tokens,
    do_sample, temperature, top_k, top_p, repetition_penalty, eos_token_id, pad_token_id,
    stop_strings + tokenizer, return_dict_in_generate, ...). `quasar_config` chooses the drafter.
    `generator` seeds the acceptance and sampling randomness (None: torch's global RNG).
    Runs `generate` with the Quasar strategy (quasar_hf.speculative.strategy).
    """
    if attention_mask is not None:
        generate_kwargs["attention_mask"] = attention_mask
    return generate_with_quasar(
        model,
        input_ids,
        generation_config=generation_config,
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        streamer=streamer,
        quasar=quasar_config,
        quasar_generator=generator,
        tokenizer=tokenizer,
        **generate_kwargs,
    )
