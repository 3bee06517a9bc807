"""quasar_hf: Quasar (W8A8 SmoothQuant-verified speculative decoding) for Hugging Face Transformers.

Importing the package registers quant_method "quasar" with Transformers.
"""

from quasar_hf.hf import QuasarConfig, is_quasar_model, register_with_transformers
from quasar_hf.nn import W8A8Linear

register_with_transformers()

__version__ = "0.1.0"
__all__ = ["QuasarConfig", "W8A8Linear", "is_quasar_model", "__version__"]
