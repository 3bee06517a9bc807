"""A static cache's steps get their attention mask prepared once per step (4D bool [B, 1, n, slots]): the
mask Transformers builds from the 2D slot mask, so the same bits, passed as given; a compiled step then reads
one mask instead of rebuilding it for every layer (Inductor recomputed it per layer: a quarter of a 4-row verify step)."""

from __future__ import annotations

import pytest
import torch

from quasar_hf.speculative import static_cache
from quasar_hf.speculative.left_padding import left_padded
from quasar_hf.speculative.static_cache import StaticVerifierCache, static_cache_slots
from tests.helpers.prompts import repeating_prompt
from tests.helpers.tiny_archs import save_tiny_arch
from tests.helpers.tiny_models import quasar_model, tiny_model

needs_kernels = pytest.mark.kernels("rowstable_linear", "attention")

CPU = torch.device("cpu")


def steps_with_holes(model, rows: int | None = None, masks: list | None = None) -> list[torch.Tensor]:
    """Prefill a left-padded batch of 3, verify 4 tokens, keep a different count per row (holes in the slot mask),
    decode one token, verify again: the logits of every forward. `masks` collects what each forward was given."""
    ids, mask = left_padded([repeating_prompt(0, 30), repeating_prompt(1, 12), repeating_prompt(2, 20)])

    def step(**kwargs):
        if masks is not None:
            masks.append(tuple(kwargs["attention_mask"].shape))
        return model(**kwargs)

    cache = StaticVerifierCache(model, rows or 3, CPU, static_cache_slots(80), step, batch_size=3)
    logits = [cache.forward(ids, mask, last_only=True)]
    logits.append(cache.forward(torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])))
    cache.keep_accepted(torch.tensor([1, 4, 2]), 4)
    logits.append(cache.forward(torch.tensor([[17], [18], [19]])))
    logits.append(cache.forward(torch.tensor([[20, 21, 22], [23, 24, 25], [26, 27, 28]])))
    return logits


def two_d_only(monkeypatch) -> None:
    monkeypatch.setattr(static_cache, "BOOL_MASK_ATTENTION", ())  # every forward gets the 2D slot mask


@pytest.mark.parametrize("rows", [3, 4])
def test_the_prepared_mask_gives_the_logits_of_the_2d_slot_mask_sdpa(monkeypatch, rows):
    """A float SDPA model; 4 rows: a padded compiled batch, its idle row seeing only its own tokens."""
    model = tiny_model()
    with torch.no_grad():
        prepared = steps_with_holes(model, rows)
        two_d_only(monkeypatch)
        reference = steps_with_holes(model, rows)
    for step, (a, b) in enumerate(zip(prepared, reference)):
        assert torch.equal(a, b), f"forward {step}"


@needs_kernels
def test_the_prepared_mask_gives_the_logits_of_the_2d_slot_mask_rowstable(tmp_path, monkeypatch):
    """A Quasar W8A8 model on the row-stable attention kernel (which reads the mask as each row's visible keys)."""
    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    with torch.no_grad():
        prepared = steps_with_holes(model, 4)
        two_d_only(monkeypatch)
        reference = steps_with_holes(model, 4)
    for step, (a, b) in enumerate(zip(prepared, reference)):
        assert torch.equal(a, b), f"forward {step}"


def test_steps_get_a_4d_mask_only_where_the_attention_reads_one_as_sdpa_does(tmp_path):
    """Steps (the prefill runs the model itself, with the 2D mask); an eager-attention model reads additive float
    masks and a sliding-window model needs Transformers' per-layer masks: both keep the 2D slot mask."""
    seen: list = []
    with torch.no_grad():
        steps_with_holes(tiny_model(), 4, seen)
    slots = static_cache_slots(80)
    assert seen == [(4, 1, 4, slots), (4, 1, 1, slots), (4, 1, 3, slots)]
    eager = tiny_model()
    eager.set_attn_implementation("eager")
    seen.clear()
    with torch.no_grad():
        steps_with_holes(eager, 4, seen)
    assert all(len(shape) == 2 for shape in seen)

    from transformers import AutoModelForCausalLM

    sliding = AutoModelForCausalLM.from_pretrained(save_tiny_arch(tmp_path / "gemma3", "gemma3")).eval()
    cache = StaticVerifierCache(sliding, 1, CPU, static_cache_slots(40))
    assert cache.has_sliding_layers and not cache._step_mask
