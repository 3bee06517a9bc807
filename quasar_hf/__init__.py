"""quasar_hf: Quasar (W8A8 SmoothQuant-verified speculative decoding) for Hugging Face Transformers.

Importing the package registers quant_method "quasar" with Transformers (its quantizer registry)
and the self drafter with the speculative loop's drafter registry. Nothing else changes:
Quasar models get `generate` with Quasar as its default and model-card saving on the instance when they load,
and any causal LM can decode with `model.generate(ids, custom_generate=quasar_hf.generate, quasar=...)`.
"""

from quasar_hf.hf import QuasarConfig, is_quasar_model, register_self_drafter, register_with_transformers
from quasar_hf.nn import W8A8Linear, prepare_weights, set_backend
from quasar_hf.ops.rowstable_attention import use_rowstable_attention
from quasar_hf.speculative import QuasarGenerationConfig, speculative_generate
from quasar_hf.speculative.strategy import generate
from quasar_hf.speculative.warm_up import warm_up

register_with_transformers()
register_self_drafter()

__version__ = "0.1.0"
__all__ = [
    "QuasarConfig",
    "QuasarGenerationConfig",
    "W8A8Linear",
    "generate",
    "is_quasar_model",
    "prepare_weights",
    "set_backend",
    "speculative_generate",
    "use_rowstable_attention",
    "warm_up",
    "__version__",
]
