"""prepare_weights(model): pack and bind every W8A8 kernel and folded norm once, in the right order."""

from __future__ import annotations

from torch import nn

from quasar_hf.nn.folded_norm import FoldedRMSNorm
from quasar_hf.nn.w8a8_linear import W8A8Linear


def prepare_weights(model: nn.Module) -> int:
    """Validate, pack and bind the kernels of every W8A8Linear in `model`, then the folded norms over them.

    Loading, `.to()` and `load_state_dict` do this themselves; call it after editing a quantized
    weight (or a folded norm's weight) in place, which the forward does not check. Returns the
    number of W8A8Linears prepared.
    """
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    for linear in linears:
        linear.prepare()
    for norm in model.modules():
        if isinstance(norm, FoldedRMSNorm):
            norm.prepare()
    return len(linears)
