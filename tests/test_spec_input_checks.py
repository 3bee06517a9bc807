"""Input checks of the speculative loop that run before any forward: the assistant's vocabulary,
the drafter value, empty rows in a batch, and token ids outside the vocabulary."""

from __future__ import annotations

import pytest
import torch

from quasar_hf.speculative import NgramDrafter, QuasarGenerationConfig, speculative_generate
from tests.helpers.prompts import repetitive_prompt
from tests.helpers.spec_models import tiny_verifier

VERIFIER_VOCAB = 256  # tests.helpers.spec_models' tiny verifiers


def count_forwards(*models) -> list[int]:
    calls = [0]
    for model in models:
        model.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    return calls


def padded_assistant(extra_rows: int) -> torch.nn.Module:
    """A same-tokenizer assistant whose table has `extra_rows` padding rows that always win the argmax."""
    assistant = tiny_verifier(seed=7, vocab=VERIFIER_VOCAB + extra_rows)
    head = assistant.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[VERIFIER_VOCAB:] = 1e4  # padding ids would be every draft if they were allowed
    assistant.lm_head = biased
    return assistant


@pytest.mark.parametrize("do_sample", [False, True])
def test_assistant_with_a_smaller_vocabulary_is_refused_before_any_forward(do_sample):
    verifier = tiny_verifier()
    assistant = tiny_verifier(seed=7, vocab=128)
    calls = count_forwards(verifier, assistant)
    with pytest.raises(ValueError) as error:
        speculative_generate(
            verifier, repetitive_prompt(0), quasar_config={"assistant_model": assistant}, max_new_tokens=8, do_sample=do_sample
        )
    message = str(error.value)
    assert "128" in message and str(VERIFIER_VOCAB) in message and "tokenizer" in message
    assert calls[0] == 0


def test_assistant_with_padding_rows_drafts_only_verifier_ids_greedy():
    verifier, assistant = tiny_verifier(), padded_assistant(64)
    prompt = repetitive_prompt(1)
    plain = verifier.generate(prompt, max_new_tokens=12, do_sample=False)
    out = speculative_generate(
        verifier, prompt, quasar_config={"assistant_model": assistant}, max_new_tokens=12, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, plain)
    assert out.quasar_stats.drafted_tokens > 0


def test_assistant_with_padding_rows_samples():
    verifier, assistant = tiny_verifier(), padded_assistant(64)
    out = speculative_generate(
        verifier,
        repetitive_prompt(2),
        quasar_config={"assistant_model": assistant},
        max_new_tokens=12,
        do_sample=True,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.shape[1] == repetitive_prompt(2).shape[1] + 12 and int(out.max()) < VERIFIER_VOCAB


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
    verifier = tiny_verifier()
    prompt = repetitive_prompt(3)
    ids = torch.cat([prompt, prompt])
    mask = torch.ones_like(ids)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"Row\(s\) \[1\] of the batch are empty") as error:
        speculative_generate(verifier, ids, mask, max_new_tokens=4)
    assert "Right padding" not in str(error.value)


@pytest.mark.parametrize("bad", [VERIFIER_VOCAB, 10**6, -1])
def test_an_id_outside_the_vocabulary_is_one_clear_error_before_any_forward(bad):
    verifier = tiny_verifier()
    calls = count_forwards(verifier)
    ids = repetitive_prompt(3).clone()
    ids[0, 4] = bad
    with pytest.raises(ValueError, match=rf"token id {bad} \(row 0, position 4\), outside this model's vocabulary of 256"):
        speculative_generate(verifier, ids, max_new_tokens=4)
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        speculative_generate(verifier, torch.cat([ids, ids]), max_new_tokens=4, quasar_config={"cache_implementation": "static"})
    assert calls == [0]
