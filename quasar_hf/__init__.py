"""quasar_hf: Quasar (W8A8 SmoothQuant-verified speculative decoding) for Hugging Face Transformers.

Importing the package registers quant_method "quasar" with Transformers, lets `generate` take
`quasar=...` and makes `save_pretrained` / `push_to_hub` of Quasar models write a model card.
The last two wrap Transformers methods once (idempotently), because Transformers has no hook for
extra generate keywords or for after-save work; both act only on Quasar models.
"""

from quasar_hf.hf import QuasarConfig, is_quasar_model, register_with_transformers
from quasar_hf.hf.generate_hook import install_generate_hook
from quasar_hf.hf.save_hook import install_save_hook
from quasar_hf.nn import W8A8Linear
from quasar_hf.speculative import QuasarGenerationConfig, speculative_generate
from quasar_hf.speculative.attention import use_rowstable_attention

register_with_transformers()
install_generate_hook()
install_save_hook()

__version__ = "0.1.0"
__all__ = [
    "QuasarConfig",
    "QuasarGenerationConfig",
    "W8A8Linear",
    "is_quasar_model",
    "speculative_generate",
    "use_rowstable_attention",
    "__version__",
]
