"""KV-cache appends written into spare storage give the bits concatenation gives (tiny W8A8 models)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicLayer

import quasar_hf  # noqa: F401  (registers quant_method "quasar")
from quasar_hf import QuasarConfig, compat
from quasar_hf.speculative.append_in_place import AppendInPlaceLayer
from quasar_hf.speculative.row_aligned_cache import RowAlignedCache
from tests.helpers.tiny_models import save_tiny, tiny_model

pytestmark = pytest.mark.kernels("attention")
FAST = dict(num_calibration_samples=4, calibration_seq_len=64)


@pytest.fixture(scope="module")
def w8a8_model(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("llama"), "llama", dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=QuasarConfig(**FAST), dtype=torch.bfloat16).eval()


def pair(model, batch=1):
    """(state appending in place, state with Transformers' concatenating layers)."""
    in_place = RowAlignedCache(model, batch, torch.device("cpu"))
    assert all(type(layer).__name__ == "AppendInPlaceLayer" for layer in in_place.cache.layers)
    concat = RowAlignedCache(model, batch, torch.device("cpu"))
    concat.cache.layers[:] = [DynamicLayer() for _ in concat.cache.layers]
    return in_place, concat


def assert_same(a, b):
    for la, lb in zip(a.cache.layers, b.cache.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    assert torch.equal(a.slot_mask, b.slot_mask) and torch.equal(a.valid_len, b.valid_len)


def test_decode_verify_and_rollback_match_concatenation(w8a8_model, monkeypatch):
    monkeypatch.setattr(AppendInPlaceLayer, "spare_slots", 3)  # grow often
    g = torch.Generator().manual_seed(0)
    states = pair(w8a8_model)
    with torch.no_grad():
        for s in states:
            s.logits = [s.forward(torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(1)))]
        for step in range(8):
            n = 1 if step % 3 == 0 else 6
            tokens = torch.randint(0, 96, (1, n), generator=g)
            keep = torch.tensor([step % n + 1]) if n > 1 else None
            for s in states:
                s.logits.append(s.forward(tokens))
                if keep is not None:
                    s.keep_accepted(keep, n)  # rejected drafts cropped away
            assert torch.equal(states[0].logits[-1], states[1].logits[-1]), f"step {step}"
            assert_same(*states)


def test_rows_with_holes_and_row_selection_match_concatenation(w8a8_model):
    g = torch.Generator().manual_seed(2)
    states = pair(w8a8_model, batch=2)
    prompt = torch.randint(0, 96, (2, 12), generator=g)
    mask = torch.ones_like(prompt)
    mask[0, -3:] = 0  # a ragged prompt: right padding becomes holes
    with torch.no_grad():
        for s in states:
            s.last = s.forward(prompt, mask)
        for step in range(4):
            tokens = torch.randint(0, 96, (2, 4), generator=g)
            for s in states:
                s.last = s.forward(tokens)
                s.keep_accepted(torch.tensor([1 + step % 4, 4]), 4)
            assert torch.equal(states[0].last, states[1].last)
            assert_same(*states)
        for s in states:
            s.select_rows(torch.tensor([1]))
            s.last = s.forward(torch.tensor([[7, 8, 9]]))
        assert torch.equal(states[0].last, states[1].last)
        assert_same(*states)


def test_other_attention_paths_keep_concatenation():
    model = tiny_model(dtype=torch.bfloat16)  # SDPA: may read a strided cache another way
    state = RowAlignedCache(model, 1, torch.device("cpu"))
    assert all(type(layer) is DynamicLayer for layer in state.cache.layers)


def test_in_place_layers_count_as_full_attention_layers():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    class OtherDynamicLayer(DynamicLayer):
        pass

    assert compat.is_full_attention_layer(DynamicLayer()) and compat.is_full_attention_layer(AppendInPlaceLayer())
    assert not compat.is_full_attention_layer(DynamicSlidingWindowLayer(sliding_window=4))
    assert not compat.is_full_attention_layer(OtherDynamicLayer())  # a subclass may store its keys its own way
