"""`model.generate(..., quasar=...)`: route Quasar models' generate calls to the speculative loop.

Why a wrapper: Transformers validates `generate`'s keyword arguments and rejects unknown ones
(`quasar=`) before any extension point (custom_generate, logits processors) runs, so the
keyword must be taken off before Transformers sees it. `install_generate_hook()` therefore
wraps `GenerationMixin.generate` once (idempotent); every call without `quasar` (and without
an assistant on a Quasar model) goes to the original method untouched.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from transformers.generation.utils import GenerationMixin

from .detect import is_quasar_model

_HOOK_MARKER = "_quasar_generate_hook"

NOT_QUANTIZED_HELP = (
    "quasar=... needs a Quasar W8A8 model. Quantize it first: "
    "`import quasar_hf; from quasar_hf import QuasarConfig; model = AutoModelForCausalLM.from_pretrained(path, "
    "quantization_config=QuasarConfig(), dtype=torch.bfloat16)`. To run the same speculative loop with this "
    "(unquantized) model as verifier, call quasar_hf.speculative.speculative_generate(model, input_ids, ...)."
)
# generate() arguments the speculative loop cannot honour: refused with a clear error.
_REFUSED_ARGUMENTS = ("prefix_allowed_tokens_fn", "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate")


def install_generate_hook() -> None:
    """Wrap GenerationMixin.generate so it accepts `quasar=`; calling it again does nothing."""
    if getattr(GenerationMixin.generate, _HOOK_MARKER, False):
        return
    GenerationMixin.generate = _wrap(GenerationMixin.generate)


def uninstall_generate_hook() -> None:
    """Restore the original GenerationMixin.generate (for tests and opt-out)."""
    original = getattr(GenerationMixin.generate, "__wrapped__", None)
    if getattr(GenerationMixin.generate, _HOOK_MARKER, False) and original is not None:
        GenerationMixin.generate = original


def _wrap(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args: Any, **kwargs: Any):
        quasar = kwargs.pop("quasar", None)
        if quasar is False:  # explicit opt-out: Transformers' own decoding, untouched
            return original(self, *args, **kwargs)
        if quasar is None:
            if is_quasar_model(self) and _assistant_of(signature, self, args, kwargs) is not None:
                return _speculative(self, signature, args, kwargs, True)  # W8A8 verification of assistant drafts
            return original(self, *args, **kwargs)
        if not is_quasar_model(self):
            raise ValueError(NOT_QUANTIZED_HELP)
        return _speculative(self, signature, args, kwargs, quasar)

    setattr(generate, _HOOK_MARKER, True)
    return generate


def _assistant_of(signature: inspect.Signature, model, args: tuple, kwargs: dict):
    return signature.bind_partial(model, *args, **kwargs).arguments.get("assistant_model")


def _speculative(model, signature: inspect.Signature, args: tuple, kwargs: dict, quasar: Any):
    """Translate generate()'s arguments into a speculative_generate call."""
    from quasar_hf.speculative import QuasarGenerationConfig, speculative_generate

    bound = signature.bind(model, *args, **kwargs).arguments
    extra = dict(bound.pop("kwargs", {}))
    for name in _REFUSED_ARGUMENTS:
        if bound.get(name) is not None:
            raise ValueError(f"generate(quasar=...) does not support {name}=; remove it or call generate without quasar.")
    if bound.get("synced_gpus"):
        raise ValueError("generate(quasar=...) does not support synced_gpus=True (multi-GPU lockstep decoding).")
    config = QuasarGenerationConfig.from_value(quasar)
    assistant = bound.get("assistant_model")
    if assistant is not None:
        config = QuasarGenerationConfig(
            **{
                **config.__dict__,
                "assistant_model": assistant,
                "drafter": "assistant" if config.drafter == "ngram" else config.drafter,
            }
        )
    input_ids = bound.get("inputs")
    if input_ids is None:
        input_ids = extra.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("generate(quasar=...) needs input_ids (the tokenized prompt).")
    return speculative_generate(
        model,
        input_ids,
        extra.pop("attention_mask", None),
        generation_config=bound.get("generation_config"),
        quasar_config=config,
        logits_processor=bound.get("logits_processor"),
        stopping_criteria=bound.get("stopping_criteria"),
        streamer=bound.get("streamer"),
        tokenizer=extra.pop("tokenizer", None),
        generator=extra.pop("quasar_generator", None),
        **extra,
    )
