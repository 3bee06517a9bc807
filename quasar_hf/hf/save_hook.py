"""Make `save_pretrained` / `push_to_hub` of Quasar models write our model card.

Transformers gives quantizers no hook after saving, and its `push_to_hub` overwrites README.md
with a generic card (or the remote one) *after* calling `save_pretrained`. So we wrap the two
`PreTrainedModel` methods once, and the wrappers act only on Quasar models
(`is_quasar_model`); every other model goes straight to the original method.
  * save_pretrained: the original save, then the card (`model_card.write_model_card`: README.md,
    or QUASAR_MODEL_CARD.md beside a README we did not write, with a warning);
  * push_to_hub: `quasar_hf.hf.hub.push_quasar_model` (same upload API, card kept).
The wrapping is idempotent (a marker attribute on the wrapper): calling `install_save_hook()`
again, or importing quasar_hf twice, never wraps twice.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from quasar_hf.hf.detect import is_quasar_model

HOOK_MARKER = "__quasar_card_hook__"


def _wrap_save_pretrained(original: Callable) -> Callable:
    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args: Any, **kwargs: Any):
        result = original(self, save_directory, *args, **kwargs)
        if is_quasar_model(self) and kwargs.get("is_main_process", True):
            save_card(self, save_directory)
        return result

    setattr(save_pretrained, HOOK_MARKER, original)
    return save_pretrained


def _wrap_push_to_hub(original: Callable) -> Callable:
    @functools.wraps(original)
    def push_to_hub(self, repo_id: str, *args: Any, **kwargs: Any):
        if not is_quasar_model(self):
            return original(self, repo_id, *args, **kwargs)
        if args:
            raise TypeError("push_to_hub of a Quasar model takes its options as keywords (repo_id, *, token=..., ...)")
        from quasar_hf.hf.hub import push_quasar_model

        return push_quasar_model(self, repo_id, **kwargs)

    setattr(push_to_hub, HOOK_MARKER, original)
    return push_to_hub


def save_card(model: Any, save_directory: Any) -> None:
    """Render and write the card; a card failure warns instead of failing an otherwise good save."""
    from quasar_hf.hf.model_card import model_card_for, write_model_card

    try:
        write_model_card(save_directory, model_card_for(model))
    except (ValueError, TypeError, OSError) as error:
        warnings.warn(f"quasar_hf could not write the model card to {save_directory}: {error}", UserWarning, stacklevel=3)


def install_save_hook() -> None:
    """Wrap PreTrainedModel.save_pretrained and .push_to_hub once (idempotent)."""
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel.save_pretrained, HOOK_MARKER):
        PreTrainedModel.save_pretrained = _wrap_save_pretrained(PreTrainedModel.save_pretrained)
    if not hasattr(PreTrainedModel.push_to_hub, HOOK_MARKER):
        PreTrainedModel.push_to_hub = _wrap_push_to_hub(PreTrainedModel.push_to_hub)


def is_save_hook_installed() -> bool:
    """True once install_save_hook() has run in this process."""
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel.save_pretrained, HOOK_MARKER) and hasattr(PreTrainedModel.push_to_hub, HOOK_MARKER)
