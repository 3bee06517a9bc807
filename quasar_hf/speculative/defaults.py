"""Quasar as a checkpoint's default: what a `generate` call without `quasar=` runs.

A Quasar model decodes with Quasar unless told otherwise: greedy Quasar output is exactly plain
greedy decoding and sampling is exact speculative sampling, so the default changes speed, not
output. The setting lives in the generation config, as the field `quasar` (True, False, or a dict
of QuasarGenerationConfig options): the checkpoint's `generation_config.json` carries it, and a
GenerationConfig passed to one call (a `transformers serve` request's `generation_config` JSON)
overrides it. A checkpoint that says nothing is on. Any other value raises a ValueError naming the file (or
the passed config) and the field, at the first call that reads it and at save_pretrained (hf/binding.py).

The keyword `quasar=` is an explicit request: options the speculative loop does not implement
raise, naming the option. A default is not: a call with such options (beam search, output_scores,
a KV cache passed in, ...) runs plain decoding instead (`call_rules.check_call` says why, `log_declined`
logs it once at info level).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from .call_rules import generate_arguments

logger = logging.getLogger(__name__)

FIELD = "quasar"  # the GenerationConfig attribute (generation_config.json key) holding the default


def default_quasar(model: Any, args: tuple, kwargs: dict) -> Any:
    """The `quasar` setting a call without `quasar=` runs with: the passed GenerationConfig's field, else
    the model's, else True (a Quasar checkpoint that says nothing). False means plain decoding. A value
    that is none of these raises a ValueError naming where it came from (checked_setting)."""
    passed = generate_arguments(args, kwargs).get("generation_config")
    value = getattr(passed, FIELD, None)
    if value is not None:
        return checked_setting(value, f'the generation_config passed to generate: its field "{FIELD}"')
    value = getattr(getattr(model, "generation_config", None), FIELD, None)
    return True if value is None else checked_setting(value, model_field(model))


def model_field(model: Any) -> str:
    """Where the model's `quasar` setting is read from, for messages: its checkpoint's generation_config.json."""
    from quasar_hf import compat

    source = compat.name_or_path(model)
    checkpoint = f"{source.rstrip('/')}/generation_config.json" if source else "the checkpoint's generation_config.json"
    return f'the field "{FIELD}" of {checkpoint} (model.generation_config.{FIELD})'


def checked_setting(value: Any, where: str) -> Any:
    """`value`, a `quasar` setting read from `where`, when generate can run it: true, false or a dict of Quasar
    options; else a ValueError naming `where`, the value and the fix (never the keyword quasar=, not passed)."""
    from .config import QuasarGenerationConfig

    if value is True or value is False:
        return value
    problem = f"{value!r} ({type(value).__name__})"
    if isinstance(value, dict):
        try:
            QuasarGenerationConfig.from_value(value)
            return value
        except (TypeError, ValueError) as error:
            problem = f"{value!r}: {error}"
    raise ValueError(
        f"{where} is {problem}; it takes true, false or an object of Quasar options (such as "
        f'{{"num_draft_tokens": 4}}): true decodes with Quasar (the default), false decodes plainly. Fix it there, or '
        f"set model.generation_config.{FIELD}; until then a generate call that reads the default, and a save, raise."
    )


@functools.cache
def log_declined(reason: str) -> None:
    """Say once per reason and process, at info level, that a call runs plain decoding instead of the default."""
    logger.info("quasar_hf: this generate call runs plain decoding instead of the default Quasar decoding: %s", reason)
