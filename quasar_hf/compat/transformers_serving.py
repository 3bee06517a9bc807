"""Names of `transformers serve` that quasar's server relies on: the error item its stream handlers read,
the Rust tokenizer its DirectStreamer decodes with, and the log filter for a Quasar config read by a
model class named directly (as `transformers serve` loads a model).
"""

from __future__ import annotations

import logging
from typing import Any


def serving_stream_error(message: str) -> Any:
    """The item Transformers' serving handlers read from a stream queue as "this request failed: message"."""
    from transformers.cli.serving.utils import _StreamError

    return _StreamError(message)


def rust_tokenizer(processor: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a fast tokenizer or a processor (what DirectStreamer decodes with)."""
    return getattr(processor, "tokenizer", processor)._tokenizer


class _MarkedConfigRead(logging.Filter):
    """Drops Transformers' "You are using a model of type `quasar_hf` to instantiate a model of type ..." record."""

    def __init__(self, model_type: str) -> None:
        super().__init__()
        self.prefix = f"You are using a model of type `{model_type}` to instantiate"

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefix)


def quiet_config_type_warning(model_type: str) -> None:
    """A model class named directly (`LlamaForCausalLM.from_pretrained`, as `transformers serve` loads) reads a
    config.json of `model_type` with its own config class, and Transformers warns that the types differ. For
    a Quasar checkpoint read with quasar_hf imported, that read is right, so only this message about only this
    type is dropped from the logger Transformers emits it on (idempotent)."""
    logger = logging.getLogger("transformers.configuration_utils")
    if not any(
        isinstance(f, _MarkedConfigRead) and f.prefix.startswith(f"You are using a model of type `{model_type}`")
        for f in logger.filters
    ):
        logger.addFilter(_MarkedConfigRead(model_type))
