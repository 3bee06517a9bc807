"""Input checks of the speculative loop that run before any forward: the assistant's vocabulary,
the drafter value, and empty rows in a batch."""

from __future__ import annotations

import pytest
import torch
from test_spec_loop import repetitive_prompt, tiny_model

from quasar_hf.speculative import NgramDrafter, QuasarGenerationConfig, speculative_generate


@pytest.mark.parametrize(
    "drafter, error, words",
    [
        (42, TypeError, "got int, which lacks start, propose, on_accept, select_rows"),
        ("eagle", ValueError, "Unknown drafter 'eagle'"),
        (NgramDrafter, TypeError, "pass an instance"),
        (object(), TypeError, "lacks start"),
    ],
)
def test_drafter_value_is_validated(drafter, error, words):
    with pytest.raises(error, match=words):
        QuasarGenerationConfig(drafter=drafter)
    with pytest.raises(error, match=words):
        QuasarGenerationConfig.from_value({"drafter": drafter})
    assert QuasarGenerationConfig(drafter=NgramDrafter()).drafter is not None  # a ready Drafter object


def test_an_empty_row_is_reported_as_empty_not_as_right_padding():
    verifier = tiny_model()
    prompt = repetitive_prompt(3)
    ids = torch.cat([prompt, prompt])
    mask = torch.ones_like(ids)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"Row\(s\) \[1\] of the batch are empty") as error:
        speculative_generate(verifier, ids, mask, max_new_tokens=4)
    assert "Right padding" not in str(error.value)
