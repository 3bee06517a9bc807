"""The dual-precision model's self-draft path: chosen decoder layers (`path`), a reduced-vocabulary
head (`head`), how the layers are chosen (`layer_search`), and the drafters built on them (`drafters`)."""

from quasar_hf.self_draft.drafters import register_self_drafter

__all__ = ["register_self_drafter"]
