"""Input checks of the speculative loop that run before any forward: the assistant's vocabulary,
the drafter value, and empty rows in a batch."""

from __future__ import annotations

import pytest

from quasar_hf.speculative import NgramDrafter, QuasarGenerationConfig


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
