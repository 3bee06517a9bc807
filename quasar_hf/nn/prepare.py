"""prepare_weights(model): pack and bind every W8A8 kernel and norm-folded linear once;
set_backend(model, name): run a loaded Quasar model's W8A8 linears on another backend."""

from __future__ import annotations

from torch import nn

from quasar_hf.nn.norm_folded_linear import NormFoldedW8A8Linear
from quasar_hf.nn.w8a8_linear import W8A8Linear
from quasar_hf.ops.dispatch import BACKENDS, resolve_backend


def prepare_weights(model: nn.Module, unprepared_only: bool = False) -> int:
    """Validate, pack and bind the kernels of every W8A8Linear in `model`, and the norm-folded linears' scales.

    Loading, `.to()` and `load_state_dict` do this themselves; call it after editing a quantized
    weight (or a norm-folded linear's norm weight) in place, which the forward does not check.
    `unprepared_only`: skip the W8A8Linears prepared already (a load, after fusion packed the stacked
    ones). Returns the number of W8A8Linears prepared.
    """
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear) and not (unprepared_only and m.prepared is not None)]
    for linear in linears:
        linear.prepare()
    for norm in model.modules():
        if isinstance(norm, NormFoldedW8A8Linear):
            norm.prepare()
    return len(linears)


def set_backend(model: nn.Module, backend: str) -> int:
    """Run every W8A8Linear of a loaded Quasar model on `backend` ("auto" or a name from
    `quasar_hf.ops.BACKENDS`), preparing each again, and record the choice in
    `model.config.quantization_config.backend` (so `save_pretrained` keeps it).

    This is how to choose the backend of a saved checkpoint after `from_pretrained` (a
    `QuasarConfig` passed when loading one is ignored by Transformers, which keeps the saved
    config). Checked before anything changes: an unknown name, or a backend that cannot run on a
    weight's device, raises a ValueError and leaves the model as it was. Returns the number of
    W8A8Linears switched.
    """
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    if not linears:
        raise ValueError("set_backend needs a Quasar model (one with W8A8Linear modules); load or quantize it with QuasarConfig")
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"unknown backend {backend!r}; choose 'auto' or one of {list(BACKENDS)}")
    for device in {m.weight.device for m in linears if m.weight.device.type != "meta"}:
        resolve_backend(backend, device)  # raises, naming why, before any module changes
    for linear in linears:
        linear.backend = backend  # prepares again
    qconfig = getattr(getattr(model, "config", None), "quantization_config", None)
    if isinstance(qconfig, dict):
        qconfig["backend"] = backend
    elif qconfig is not None:
        qconfig.backend = backend
    return len(linears)
