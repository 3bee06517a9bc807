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
from transformers import AutoModelForCausalLM, LlamaConfig

import quasar_hf.speculative.loop as loop_module
from quasar_hf.speculative import QuasarGenerationConfig, speculative_generate
from quasar_hf.speculative.verify import speculative_sample_accept

VOCAB = 12
NUM_SAMPLES = 3000
SEED_TEXT = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2]])


def peaked_model(seed, scale=15.0):
    """Tiny model whose next-token distributions are far from uniform (so drafts are often plausible)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@torch.no_grad()
def grounded_prompt(model):
    """Seed text + the model's own greedy continuation: n-gram drafts then carry real target mass."""
    return model.generate(SEED_TEXT, max_new_tokens=20, do_sample=False)


def processors_of(model, prompt, options):
    """The logits processors plain generate builds for these options (captured by a custom_generate callable)."""
    captured = {}

    def capture(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        captured["processors"] = logits_processor
        return input_ids

    model.generate(prompt, custom_generate=capture, **dict(options, max_new_tokens=3))
    return captured["processors"]


@torch.no_grad()
def exact_joint(model, prompt, options):
    """P(t1, t2, t3) [V, V, V] under plain sampling with the processors plain generate builds."""
    process = processors_of(model, prompt, options)
    joint = torch.ones(1)
    prefixes = prompt
    for _ in range(3):
        logits = model(prefixes).logits[:, -1].float()
        scores = torch.cat([process(row[None], row_logits[None]) for row, row_logits in zip(prefixes, logits)])
        probs = torch.softmax(scores, dim=-1)  # [n, V]
        joint = (joint[:, None] * probs).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(prefixes.shape[0])[:, None]], 1)
    return joint.view(VOCAB, VOCAB, VOCAB)


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


def chi_square_p_value(counts, probs):
    """Pearson chi-square; cells with expected count < 5 are pooled into one cell."""
    expected = probs.reshape(-1).double() * counts.sum()
    counts = counts.double()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2).item()


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
        monkeypatch.setattr(loop_module, "speculative_sample_accept", wrong)
        p_wrong = chi_square_p_value(sampled_joint(model, prompt, quasar, options, seed=11), target)
        assert p_wrong < 1e-8, f"negative control {wrong.__name__} not detected: p = {p_wrong:.2e}"
    monkeypatch.undo()
