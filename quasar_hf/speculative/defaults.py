"""Quasar as a checkpoint's default: what a `generate` call without `quasar=` runs.

A Quasar model decodes with Quasar unless told otherwise: greedy Quasar output is exactly plain
greedy decoding and sampling is exact speculative sampling, so the default changes speed, not
output. The setting lives in the generation config, as the field `quasar` (True, False, or a dict
of QuasarGenerationConfig options): the checkpoint's `generation_config.json` carries it, and a
GenerationConfig passed to one call (a `transformers serve` request's `generation_config` JSON)
overrides it. A checkpoint that says nothing is on.

The keyword `quasar=` is an explicit request: options the speculative loop does not implement
raise, naming the option. A default is not: a call with such options (beam search, output_scores,
a streamer over a batch, ...) runs plain decoding instead (`declined_reason` says why, logged once
at info level).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from typing import Any

from transformers import GenerationConfig

from .checks import _refuse_unsupported

logger = logging.getLogger(__name__)

FIELD = "quasar"  # the GenerationConfig attribute (generation_config.json key) holding the default
# generate() arguments that are not model inputs: what a merged config does not absorb is checked as model input
_GENERATE_ARGUMENTS = (
    "inputs",
    "input_ids",
    "generation_config",
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "tokenizer",
    "quasar_generator",
    "stop_strings",
    "attention_mask",
    "use_model_defaults",
    "assistant_tokenizer",
    "compile_config",
)


def passed_generation_config(args: tuple, kwargs: dict) -> GenerationConfig | None:
    """The GenerationConfig given to generate (keyword, or second positional argument), if any."""
    config = kwargs.get("generation_config")
    if config is None and len(args) > 1 and isinstance(args[1], GenerationConfig):
        config = args[1]
    return config


def default_quasar(model: Any, args: tuple, kwargs: dict) -> Any:
    """The `quasar` setting a call without `quasar=` runs with: the passed GenerationConfig's field, else
    the model's, else True (a Quasar checkpoint that says nothing). False means plain decoding."""
    for config in (passed_generation_config(args, kwargs), getattr(model, "generation_config", None)):
        value = getattr(config, FIELD, None)
        if value is not None:
            return value
    return True


def declined_reason(model: Any, args: tuple, kwargs: dict) -> str | None:
    """Why the speculative loop would refuse this generate call (an option it does not implement), else
    None. Checked before anything runs, so a declined default falls back to plain decoding cleanly."""
    from .strategy import _REFUSED_ARGUMENTS

    try:
        arguments = _bound_arguments(args, kwargs)
    except TypeError as error:
        return str(error)
    for name in (*_REFUSED_ARGUMENTS, "inputs_embeds"):
        if arguments.get(name) is not None:
            return f"{name}= is given"
    if arguments.get("synced_gpus"):
        return "synced_gpus=True"
    config = copy.deepcopy(arguments.get("generation_config") or model.generation_config)
    options = {k: v for k, v in arguments.items() if k not in _GENERATE_ARGUMENTS}
    model_inputs = config.update(**options)  # what is not a generation option is a model input
    if getattr(config, "stop_strings", None) is not None and getattr(model.generation_config, "stop_strings", None):
        return "model.generation_config.stop_strings is set (Quasar takes stop strings per call)"
    streamer, ids = arguments.get("streamer"), arguments.get("inputs", arguments.get("input_ids"))
    if streamer is not None and not hasattr(streamer, "put_row") and getattr(ids, "dim", lambda: 0)() == 2 and ids.shape[0] > 1:
        return "a streamer over a batch of several prompts"
    for name in ("cache", "past_key_values"):
        if model_inputs.get(name) is not None:
            return f"a KV cache passed as {name}="
    try:
        _refuse_unsupported(config, model_inputs)
    except ValueError as error:
        return str(error)
    return None


def _bound_arguments(args: tuple, kwargs: dict) -> dict:
    """generate's arguments by name (positional ones as generate's signature orders them)."""
    from .strategy import generate_with_quasar

    bound = inspect.signature(generate_with_quasar).bind(None, *args, **kwargs).arguments
    bound.pop("model", None)
    bound.update(bound.pop("kwargs", {}))
    return bound


@functools.cache
def log_declined(reason: str) -> None:
    """Say once per reason and process, at info level, that a call runs plain decoding instead of the default."""
    logger.info("quasar_hf: this generate call runs plain decoding instead of the default Quasar decoding: %s", reason)
