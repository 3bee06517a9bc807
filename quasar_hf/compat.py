"""Every private Transformers name quasar_hf relies on, in one module.

Transformers' private API (underscore names, internal registries, cache layer classes) moves
between 5.x releases. The rest of the package calls the small functions here instead, so an
upgrade changes this file only; `tests/test_layering.py` fails when another module reaches a
private Transformers name.
"""

from __future__ import annotations


def allow_loading_attributes(config_class: type) -> bool:
    """Let `from_pretrained(saved_checkpoint, quantization_config=config_class(...))` apply the
    passed config's `get_loading_attributes()` over the saved config, as Transformers does for its
    own configs listed in `quantizers.auto.LOADING_ATTRIBUTES_CONFIG_TYPES` (otherwise it keeps the
    saved config and ignores the passed one). Idempotent; False if this Transformers has no such list.
    """
    from transformers.quantizers import auto

    types = getattr(auto, "LOADING_ATTRIBUTES_CONFIG_TYPES", None)
    if not isinstance(types, tuple):
        return False
    if config_class not in types:
        auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*types, config_class)
    return True
