"""A request's Quasar settings: the server's options, then the request's generation config, then the model's."""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig

from .call_rules import check_call
from .config import QuasarGenerationConfig
from .defaults import FIELD, log_declined

SERVER_OPTIONS = ("compile", "cache_implementation")  # a request cannot change these: they decide what the server compiled


def request_quasar_config(
    model: torch.nn.Module, config: GenerationConfig, override: dict | None, tokenizer: Any = None
) -> QuasarGenerationConfig | None:
    """The loop's settings for a request: the server's options (`override`), then its generation config's
    `quasar` field (else the model's); Quasar off is the loop without drafts (plain decoding). None when the
    loop declines the request's generation options (call_rules.check_call, the reason logged once); `tokenizer`:
    the request's, which its stop strings need."""
    reason = check_call(model, (), {"generation_config": config, "tokenizer": tokenizer})
    if reason is not None:
        log_declined(reason)
        return None
    setting = getattr(config, FIELD, None)
    if setting is None:
        setting = getattr(model.generation_config, FIELD, None)
    options = dict(override or {})
    if setting is False:
        options["num_draft_tokens"] = 0
    elif isinstance(setting, dict):
        options.update({k: v for k, v in setting.items() if k not in SERVER_OPTIONS})
    elif setting not in (None, True):
        raise ValueError(f"generation_config.quasar must be true, false or an object of Quasar options, got {setting!r}")
    return QuasarGenerationConfig.from_value(options or True)
