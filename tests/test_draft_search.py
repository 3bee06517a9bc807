"""Draft-layer search: the bytes-bound speedup model and the choice of layer count by it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from quasar_hf.self_draft import layer_search as draft_search
from quasar_hf.self_draft.layer_search import draft_byte_ratio, layer_bytes, predicted_speedup, select_draft_layers
from tests.helpers.tiny_models import tiny_model


def test_predicted_speedup_limits():
    speedup, k = predicted_speedup(0.0, 0.1)
    assert k == 1 and speedup == pytest.approx(1 / 1.1)  # nothing accepted: the draft only costs
    speedup, k = predicted_speedup(1.0, 0.0)
    assert k == 5 and speedup == 6.0  # free and always right: every drafted token is a token
    # E[L](0.8, 2) = 1 + 0.8 + 0.64 over 1 + 2 * 0.4 bytes (1.356) beats k = 1 (1.286) and k = 3 (1.342)
    speedup, k = predicted_speedup(0.8, 0.4)
    assert k == 2 and speedup == pytest.approx(2.44 / 1.8)
    assert predicted_speedup(0.8, 0.2)[1] == 4  # cheaper drafts: draft longer
    assert predicted_speedup(0.8, 0.3)[0] < predicted_speedup(0.8, 0.2)[0] < predicted_speedup(0.9, 0.2)[0]


def test_layer_bytes_counts_linear_weights_at_one_byte_for_int8():
    layer = nn.Sequential(nn.Linear(8, 4, bias=False), nn.LayerNorm(4))  # fp32: 32 weights + 8 norm values
    assert layer_bytes(layer, "model") == 4 * (32 + 8)
    assert layer_bytes(layer, "int8") == 32 + 4 * 8


def test_byte_ratio_of_a_reduced_head_is_smaller():
    model = tiny_model("llama", layers=4)
    full, reduced = draft_byte_ratio(model, [0, 1], "int8", None), draft_byte_ratio(model, [0, 1], "int8", 16)
    assert 0 < reduced < full < 1
    assert draft_byte_ratio(model, [0, 1], "model", None) > full  # float copies read more than int8 layers


@pytest.mark.parametrize(
    "agreement_of, want_layers",
    [
        (lambda n: 0.8, 2),  # agreement does not fall: the fewest layers (the floor) read the fewest bytes
        (lambda n: 0.9 if n >= 4 else 0.05, 4),  # agreement collapses below 4 layers: keep 4
    ],
)
def test_layer_count_chosen_by_predicted_speedup(monkeypatch, agreement_of, want_layers):
    model = tiny_model("llama", layers=12)
    monkeypatch.setattr(draft_search, "top1_agreement", lambda m, layers, b, r: agreement_of(len(layers)))
    blocks = torch.randint(0, 64, (1, 8))
    found = select_draft_layers(model, blocks, budget=0.5, progress=False, draft_dtype="int8")
    assert [c["num_layers"] for c in found["candidates"]] == [6, 5, 4, 3, 2]  # budget 6, floor ceil(12/8)
    assert len(found["layers"]) == want_layers
    assert found["predicted_speedup"] == max(c["predicted_speedup"] for c in found["candidates"])


def test_single_layer_model_is_a_clear_error():
    model = tiny_model("llama", layers=1)
    with pytest.raises(ValueError, match="at least 2 decoder layers"):
        select_draft_layers(model, torch.randint(0, 64, (1, 8)), budget=0.5, progress=False)
