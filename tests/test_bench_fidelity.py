"""Fidelity metrics and the speculative pieces they use, on tiny random models."""

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from quasar_hf.bench.fidelity import (
    aggregate_stats,
    evaluate_fidelity,
    next_token_sums,
    perplexity_ratio_interval,
    same_draft_acceptance,
    speculative_tokens,
)
from quasar_hf.speculative.stats import QuasarStats


class CharTokenizer:
    chat_template = None
    eos_token_id = 1

    def __call__(self, text):
        return {"input_ids": [ord(c) % 60 + 2 for c in text]}


def tiny_model(seed=0, vocab=64):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        eos_token_id=1,
        bos_token_id=None,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def test_stats_aggregate_to_L_and_per_position_rates():
    stats = QuasarStats()
    stats.record_step([3], [2], [3])
    stats.record_step([2], [0], [1])
    stats.record_step([0], [0], [1])
    agg = aggregate_stats([stats.to_dict(), QuasarStats().to_dict()])  # a run without verify steps adds nothing
    assert agg["mean_acceptance_length"] == pytest.approx((3 + 1 + 1) / 3)
    assert agg["acceptance_per_position"] == [0.5, 0.5, 0.0]
    assert agg["acceptance_rate"] == pytest.approx(2 / 5)


def test_speculative_tokens_reproduce_greedy_generate_exactly():
    model = tiny_model()
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 7, 8, 9, 3, 4]])
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False, pad_token_id=0)[
        0, prompt.shape[1] :
    ].tolist()
    tokens, stats = speculative_tokens(model, prompt, 30, "ngram", 4)
    assert tokens == expected[: len(tokens)] and (len(tokens) == 30 or tokens[-1] == 1)
    assert stats["verify_steps"] < len(tokens)  # some drafts were accepted


def test_same_draft_acceptance_on_the_models_own_greedy_trajectory_accepts_every_matching_draft():
    model = tiny_model()
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0].tolist()
    stats = same_draft_acceptance(model, out, len(prompt) + 1, 4)
    # along its own greedy trajectory a verifier accepts a draft token exactly when it equals the next token
    from quasar_hf.speculative.drafters import NgramDrafter

    drafter, expected = NgramDrafter(4), 0
    for t in range(len(prompt) + 1, len(out)):
        draft = drafter.lookup(torch.tensor(out[:t]), 4).tolist()
        for i, token in enumerate(draft):
            if t + i >= len(out) or out[t + i] != token:
                break
            expected += 1
    assert stats["accepted_tokens"] == expected


def test_next_token_sums_match_hand_computation():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    other = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    targets = torch.tensor([0, 2])
    sums = next_token_sums(logits, other, targets)
    p, q = logits.log_softmax(-1), other.log_softmax(-1)
    assert sums["model_nll"] == pytest.approx(float(-(p[0, 0] + p[1, 2])), rel=1e-6)
    assert sums["kl"] == pytest.approx(float((q.exp() * (q - p)).sum()), rel=1e-6)
    assert sums["top1_agree"] == 1


def test_perplexity_ratio_interval_brackets_the_ratio_and_narrows_with_more_blocks():
    generator = torch.Generator().manual_seed(3)
    reference = (torch.rand(400, generator=generator) * 100 + 1000).tolist()
    model = [r + float(torch.randn((), generator=generator)) * 10 + 2 for r in reference]  # +2 nats per 511 tokens
    tokens = [511] * 400
    ratio = math.exp((sum(model) - sum(reference)) / sum(tokens))
    low, high = perplexity_ratio_interval(model, reference, tokens)
    assert low < ratio < high and low > 1.0  # the mean shift is many standard errors above zero
    low16, high16 = perplexity_ratio_interval(model[:16], reference[:16], tokens[:16])
    assert (high16 - low16) > 3 * (high - low)  # 25x the blocks: about 5x narrower
    same = perplexity_ratio_interval(reference, reference, tokens)
    assert same == (1.0, 1.0)


def test_perplexity_ratio_interval_rejects_mismatched_blocks():
    with pytest.raises(ValueError, match="one NLL pair and token count per block"):
        perplexity_ratio_interval([1.0, 2.0], [1.0], [5, 5])
    with pytest.raises(ValueError, match="confidence"):
        perplexity_ratio_interval([1.0], [1.0], [5], confidence=1.5)


def test_identical_models_have_ratio_one_agreement_one_kl_zero_same_L():
    model = tiny_model()
    prompts = [torch.tensor([[3, 4, 5, 3, 4, 5, 6, 7, 3, 4]])]
    result = evaluate_fidelity(
        model, model, CharTokenizer(), ["abcabd abcabd " * 20], seq_len=32, acceptance_prompts=prompts, max_new_tokens=16
    )
    nt = result["next_token"]
    assert nt["perplexity_ratio"] == pytest.approx(1.0) and nt["top1_agreement"] == 1.0
    assert nt["mean_kl_nats"] == pytest.approx(0.0, abs=1e-6)
    assert result["acceptance"]["same_drafts"]["L_ratio"] == pytest.approx(1.0)


def test_perturbed_model_is_measured_as_different():
    model = tiny_model()
    noisy = copy.deepcopy(model)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    result = evaluate_fidelity(noisy, model, CharTokenizer(), ["the quick brown fox " * 20], seq_len=32)
    nt = result["next_token"]
    assert nt["mean_kl_nats"] > 1e-4 and nt["top1_agreement"] < 1.0
    assert math.isfinite(nt["perplexity_model"]) and result["acceptance"] is None


def test_bad_inputs_raise_clear_errors():
    model = tiny_model()
    with pytest.raises(TypeError, match="texts"):
        evaluate_fidelity(model, model, CharTokenizer(), "just a string")
    with pytest.raises(ValueError, match="seq_len"):
        evaluate_fidelity(model, model, CharTokenizer(), ["x"], seq_len=1)
