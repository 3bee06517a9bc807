"""What an OpenAI request body may ask of `quasar-hf serve`, checked before anything runs.

Every refusal is a `RequestError` (HTTP 400) that names the field and what it takes, so a client's
mistake never reaches the decoding worker as a 500 or fails other clients' requests. Fields that
OpenAI defines but this server does not implement (`n > 1`, `logprobs`, a JSON `response_format`)
are refused rather than ignored.

Sampling follows OpenAI's rule, which Transformers' handler does not: a positive `temperature` (or a
`top_p` below 1) samples unless the request's own `generation_config` says `do_sample`; temperature 0
is greedy; a request that names neither keeps the checkpoint's generation config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

from quasar_hf.speculative.config import QuasarGenerationConfig

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
SEED_FIELD = "quasar_seed"  # the request's seed, carried on its GenerationConfig to the worker


class RequestError(ValueError):
    """A request this server cannot run as asked (answered with HTTP 400 and this message)."""


@dataclass(frozen=True)
class SamplingChoice:
    """What a request says about sampling: do_sample to set (None: keep the config's), and its seed."""

    do_sample: bool | None
    seed: int | None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_body(body: dict, endpoint: str) -> SamplingChoice:
    """Refuse a body (RequestError) whose fields have the wrong type or range, or ask for what is not
    implemented; return its sampling choice. `endpoint`: "chat", "completions" or "responses"."""
    _check_numbers(body)
    _check_unsupported(body)
    if endpoint == "chat":
        _check_messages(body.get("messages"))
    elif endpoint == "completions":
        if not isinstance(body.get("prompt"), str):
            raise RequestError("prompt must be a string (token-id prompts are not supported)")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not stops or not all(isinstance(s, str) and s for s in stops):
            raise RequestError("stop must be a non-empty string or a list of non-empty strings")
    explicit = request_generation_config(body)
    return _sampling_choice(body, explicit)


def _check_numbers(body: dict) -> None:
    for name in MAX_TOKENS_FIELDS:
        value = body.get(name)
        if value is not None and (not _is_int(value) or value < 1):
            raise RequestError(f"{name} must be a positive integer, got {value!r}")
    ranges = {"temperature": (0.0, 2.0), "frequency_penalty": (-2.0, 2.0), "presence_penalty": (-2.0, 2.0)}
    for name, (low, high) in ranges.items():
        value = body.get(name)
        if value is not None and (not _is_number(value) or not low <= value <= high):
            raise RequestError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
    top_p = body.get("top_p")
    if top_p is not None and (not _is_number(top_p) or not 0.0 < top_p <= 1.0):
        raise RequestError(f"top_p must be a number in (0, 1], got {top_p!r}")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"seed must be an integer, got {seed!r}")
    if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
        raise RequestError(f"stream must be true or false, got {body.get('stream')!r}")


def _check_unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError(f"n must be 1 (one choice per request); send {n!r} requests instead")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise RequestError("best_of is not supported; leave it out")
    if body.get("echo"):
        raise RequestError("echo is not supported; leave it out")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise RequestError("logprobs and top_logprobs are not supported by this server; leave them out")
    if body.get("presence_penalty") not in (None, 0, 0.0):
        raise RequestError("presence_penalty is not supported; use frequency_penalty (a repetition penalty) instead")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise RequestError("response_format must be {'type': 'text'}: structured (JSON) output is not supported")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{index}] must be an object with 'role' and 'content'")
        if message.get("role") not in ROLES:
            raise RequestError(f"messages[{index}].role must be one of {', '.join(ROLES)}, got {message.get('role')!r}")
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            raise RequestError(f"messages[{index}].content is missing")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"messages[{index}].content must be a string or a list of content parts, got {content!r}")
        for part in content if isinstance(content, list) else []:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(f"messages[{index}].content parts must be objects with a 'type'")
            if part["type"] in ("text", "input_text", "output_text") and not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{index}].content text parts need a string 'text'")


def request_generation_config(body: dict) -> dict | None:
    """The request's own `generation_config` (a JSON object in a string), checked; None when absent."""
    raw = body.get("generation_config")
    if raw is None:
        return None
    try:
        settings = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError as error:
        raise RequestError(f"generation_config is not valid JSON ({error}); send a JSON object as a string") from None
    if not isinstance(settings, dict):
        raise RequestError("generation_config must be a JSON object (as a string), e.g. '{\"do_sample\": true}'")
    _check_sampling_fields(settings)
    try:
        GenerationConfig(**settings).validate(strict=False)
    except (TypeError, ValueError) as error:
        raise RequestError(f"generation_config is invalid: {error}") from None
    quasar = settings.get("quasar")
    if quasar is not None and quasar is not False:
        try:
            QuasarGenerationConfig.from_value(quasar)
        except (TypeError, ValueError) as error:
            raise RequestError(f"generation_config.quasar must be true, false or an object of Quasar options: {error}") from None
    return settings


GENERATION_RANGES = {  # field: (check, what it takes) for a request's generation_config
    "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "top_k": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "repetition_penalty": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "max_new_tokens": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
}


def _check_sampling_fields(settings: dict) -> None:
    for name, (valid, takes) in GENERATION_RANGES.items():
        if settings.get(name) is not None and not valid(settings[name]):
            raise RequestError(f"generation_config.{name} must be {takes}, got {settings[name]!r}")


def _sampling_choice(body: dict, explicit: dict | None) -> SamplingChoice:
    seed = body.get("seed")
    if explicit is not None and "do_sample" in explicit:
        return SamplingChoice(None, seed)
    temperature, top_p = body.get("temperature"), body.get("top_p")
    if temperature is not None and temperature == 0:
        return SamplingChoice(False, seed)
    if (temperature is not None and temperature > 0) or (top_p is not None and top_p < 1):
        return SamplingChoice(True, seed)
    return SamplingChoice(None, seed)


def asks_max_tokens(body: dict) -> bool:
    """True when the request sets its own token budget (else the server gives it what the context leaves)."""
    explicit = request_generation_config(body) or {}
    return any(body.get(name) is not None for name in MAX_TOKENS_FIELDS) or "max_new_tokens" in explicit


def apply_sampling(config: GenerationConfig, choice: SamplingChoice) -> GenerationConfig:
    """Set do_sample and the seed on a request's GenerationConfig; refuse settings no decoding can run."""
    if choice.do_sample is not None:
        config.do_sample = choice.do_sample
    if config.do_sample and config.temperature is not None and config.temperature <= 0:
        raise RequestError("sampling needs a positive temperature; send temperature 0 for greedy decoding")
    setattr(config, SEED_FIELD, choice.seed)
    try:
        config.validate(strict=False)
    except ValueError as error:
        raise RequestError(f"invalid generation settings: {error}") from None
    return config


def token_budget(prompt_tokens: int, requested: int | None, context: int) -> int:
    """New tokens a request may decode: what it asked (None: all the context leaves), refused past the context."""
    if prompt_tokens < 1:
        raise RequestError("the prompt is empty: send at least one token of text")
    if prompt_tokens >= context:
        raise RequestError(
            f"the prompt has {prompt_tokens} tokens, but this server holds at most {context} tokens per request "
            "(prompt plus new tokens); shorten the prompt"
        )
    room = context - prompt_tokens
    if requested is None:
        return room
    if requested > room:
        raise RequestError(
            f"the prompt ({prompt_tokens} tokens) plus max_tokens ({requested}) exceeds the {context} tokens this server "
            f"holds per request; ask for at most {room} new tokens"
        )
    return requested
