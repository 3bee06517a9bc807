"""Quasar speculative decoding as a Transformers `custom_generate` strategy (Hub / local-folder form).

`model.generate(ids, custom_generate="<this repo or folder>", trust_remote_code=True, quasar=True)`
runs `generate` below with `generate`'s own arguments; quasar_hf does the rest (see its README).
"""

from quasar_hf.speculative.strategy import generate_with_quasar


def generate(model, *args, **kwargs):
    """Quasar generation: drafts (n-gram, an assistant model, or a Quasar model's own draft layers) verified by `model`."""
    return generate_with_quasar(model, *args, **kwargs)
