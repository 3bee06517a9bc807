"""The self drafters: drafter="self" and drafter="self_reduced", built from a Quasar model's own draft path.

This module sits on top of the self-draft pieces (`path`: the draft layers, `head`: the reduced
vocabulary head, `layer_search`: what calibration predicts), so none of them imports another upward.
"""

from __future__ import annotations

from torch import nn

from quasar_hf.self_draft.head import draft_bytes_per_token, reduced_self_draft_model
from quasar_hf.self_draft.layer_search import predicted_speedup
from quasar_hf.self_draft.path import self_draft_model
from quasar_hf.speculative.drafters import DRAFTER_FACTORIES, AssistantDrafter


def calibration_prediction(model: nn.Module, reduced: bool) -> dict | None:
    """What calibration predicts for the model's self-draft path, where drafter="auto" starts its policy.

    {"acceptance": top-1 agreement measured at quantization, "draft_tokens": the best k,
    "predicted_speedup": bytes-bound speedup over plain decoding} with the draft head actually used
    (reduced or full); None for a model saved without a measured draft path.
    """
    qconfig = getattr(model.config, "quantization_config", None)
    info = getattr(qconfig, "draft_info", None) if not isinstance(qconfig, dict) else qconfig.get("draft_info")
    if not info or info.get("top1_agreement") is None:
        return None
    ratio = draft_bytes_per_token(model, reduced=reduced)["draft_over_verify"]
    speedup, k = predicted_speedup(float(info["top1_agreement"]), ratio)
    return {"acceptance": float(info["top1_agreement"]), "draft_tokens": k, "predicted_speedup": round(speedup, 4)}


def self_drafter_factory(verifier: nn.Module, config) -> AssistantDrafter:
    """drafter="self": the model's own draft path (full lm_head), drafting like an assistant model."""
    drafter = AssistantDrafter(self_draft_model(verifier), config.num_draft_tokens, **config.drafter_kwargs)
    drafter.calibration_prediction = calibration_prediction(verifier, reduced=False)
    return drafter


def self_reduced_drafter_factory(verifier: nn.Module, config) -> AssistantDrafter:
    """drafter="self_reduced": the draft path ending in the reduced-vocabulary head."""
    drafter = AssistantDrafter(reduced_self_draft_model(verifier), config.num_draft_tokens, **config.drafter_kwargs)
    drafter.calibration_prediction = calibration_prediction(verifier, reduced=True)
    return drafter


def register_self_drafter() -> None:
    """Make drafter="self" and drafter="self_reduced" available to the speculative loop (its drafter registry)."""
    DRAFTER_FACTORIES.setdefault("self", self_drafter_factory)
    DRAFTER_FACTORIES.setdefault("self_reduced", self_reduced_drafter_factory)
