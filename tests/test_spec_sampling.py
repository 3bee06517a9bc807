"""Statistical test: speculative sampling emits tokens distributed exactly as the target samples them.

Setup: a tiny fp32 model with a 12-token vocabulary, one prompt repeated over N batch rows (each
row an independent sample, fixed seeds). The exact target distribution of the first three
generated tokens (t1, t2, t3) is computed from the model with the same logits processors; t2 and
t3 come out of verify steps (draft positions 0 and 1 or the bonus token). A chi-square
goodness-of-fit test on the joint (t1, t2, t3) must not reject the correct rule (p > 1e-3)
while it rejects, by many orders of magnitude (p < 1e-8), two classic mistakes run through the
same loop: accepting every draft, and sampling a rejection from p instead of normalize(max(0, p - q)).
"""

import pytest
import torch

import quasar_hf.speculative.row_rules as row_rules_module
from quasar_hf.speculative import QuasarGenerationConfig, speculative_generate
from quasar_hf.speculative.verify import speculative_sample_accept
from tests.helpers.sampling_stats import VOCAB, chi_square_p_value, exact_joint, grounded_prompt, peaked_model

NUM_SAMPLES = 3000


def sampled_joint(model, prompt, quasar, options, seed):
    ids = prompt.repeat(NUM_SAMPLES, 1)
    out = speculative_generate(
        model,
        ids,
        torch.ones_like(ids),
        quasar_config=quasar,
        max_new_tokens=3,
        generator=torch.Generator().manual_seed(seed),
        **options,
    )
    t = out[:, prompt.shape[1] :]
    counts = torch.zeros(VOCAB**3)
    counts.index_add_(0, t[:, 0] * VOCAB**2 + t[:, 1] * VOCAB + t[:, 2], torch.ones(NUM_SAMPLES))
    return counts


def accept_everything(draft_tokens, draft_probs, target_probs, generator=None, draft_lengths=None):
    num, _ = speculative_sample_accept(draft_tokens, draft_probs, target_probs, generator, draft_lengths)
    num = draft_lengths.clone()
    bonus = torch.multinomial(target_probs[torch.arange(len(num)), num], 1, generator=generator).squeeze(1)
    return num, bonus


def resample_from_p_on_rejection(draft_tokens, draft_probs, target_probs, generator=None, draft_lengths=None):
    num, _ = speculative_sample_accept(draft_tokens, draft_probs, target_probs, generator, draft_lengths)
    nxt = torch.multinomial(target_probs[torch.arange(len(num)), num], 1, generator=generator).squeeze(1)
    return num, nxt


SETTINGS = {
    "plain": dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0),
    "processors": dict(do_sample=True, top_k=8, top_p=0.95, temperature=0.8, repetition_penalty=1.3),
}


def drafter_config(name):
    if name == "ngram":
        return QuasarGenerationConfig(drafter="ngram", num_draft_tokens=3)
    # Same weights, flatter head: q is close to p but not equal, so acceptance is high and the residual matters.
    return QuasarGenerationConfig(drafter="assistant", assistant_model=peaked_model(seed=1, scale=5.0), num_draft_tokens=3)


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("drafter", ["ngram", "assistant"])
def test_sampled_distribution_matches_target_and_wrong_rules_fail(drafter, setting, monkeypatch):
    model = peaked_model(seed=1)
    options = SETTINGS[setting]
    prompt = grounded_prompt(model)
    target = exact_joint(model, prompt, options)
    quasar = drafter_config(drafter)
    counts = sampled_joint(model, prompt, quasar, options, seed=11)
    p_correct = chi_square_p_value(counts, target)
    assert p_correct > 1e-3, f"correct rule rejected: p = {p_correct:.2e}"
    for wrong in (accept_everything, resample_from_p_on_rejection):
        monkeypatch.setattr(row_rules_module, "speculative_sample_accept", wrong)
        p_wrong = chi_square_p_value(sampled_joint(model, prompt, quasar, options, seed=11), target)
        assert p_wrong < 1e-8, f"negative control {wrong.__name__} not detected: p = {p_wrong:.2e}"
    monkeypatch.undo()
