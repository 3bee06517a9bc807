"""Reduced-vocabulary draft head (drafter="self_reduced"): index choice, exactness, save/reload, bytes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig, QuasarGenerationConfig
from quasar_hf.self_draft.head import (
    ReducedVocabLogits,
    draft_bytes_per_token,
    head_token_ids,
    reduced_self_draft_model,
    select_head_tokens,
    token_counts,
)
from quasar_hf.speculative.drafters import DRAFTER_FACTORIES, DraftSetup
from quasar_hf.speculative.verify import speculative_sample_accept
from tests.helpers.tiny_models import char_tokenizer, tiny_model

FAST = dict(num_calibration_samples=4, calibration_seq_len=64)
PROMPTS = ["the cat sat on the mat; the cat sat on the", "abcabcabcabc", "def f(x): return x + 1\ndef g(x"]


def quantized(tmp_path, **kwargs):
    tiny_model("llama", layers=4, seed=3).save_pretrained(tmp_path / "src")
    char_tokenizer().save_pretrained(tmp_path / "src")
    return AutoModelForCausalLM.from_pretrained(
        tmp_path / "src", quantization_config=QuasarConfig(**FAST, **kwargs), dtype=torch.float32
    )


def test_select_head_tokens_takes_most_frequent_and_forced_ids():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert select_head_tokens(counts, 3).tolist() == [2, 3, 5]  # 9, 9 (lower id first), 7
    assert select_head_tokens(counts, 3, always=[1]).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        select_head_tokens(counts, 7)
    assert token_counts(torch.tensor([[2, 2, 5]]), 6).tolist() == [0, 0, 2, 0, 0, 1]


def test_reduced_logits_equal_full_head_on_subset_and_minus_inf_elsewhere():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 20, bias=True)
    ids = torch.tensor([1, 4, 7, 19])
    hidden = torch.randn(2, 3, 8)
    out = ReducedVocabLogits(head, ids, 20)(hidden)  # [2, 3, 20]
    full = head(hidden)
    assert out.shape == full.shape
    torch.testing.assert_close(out[..., ids], full[..., ids])
    outside = torch.ones(20, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(out[..., outside]).all()


@pytest.mark.parametrize("draft_dtype", ["model", "int8"])
def test_self_reduced_greedy_equals_plain_greedy(tmp_path, draft_dtype):
    model = quantized(tmp_path, draft_layers=[0, 3], draft_dtype=draft_dtype, draft_vocab_size=40)
    assert model.config.quantization_config.draft_info["vocab_size"] == 40
    assert head_token_ids(model).numel() == 40
    tok = char_tokenizer()
    for text in PROMPTS:
        ids = tok(text, return_tensors="pt").input_ids
        plain = model.generate(ids, max_new_tokens=24, do_sample=False, quasar=False)
        out = model.generate(
            ids,
            max_new_tokens=24,
            do_sample=False,
            quasar=QuasarGenerationConfig(drafter="self_reduced"),
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, plain)
        assert out.quasar_stats.drafted_tokens > 0


def test_reduced_head_survives_save_and_reload(tmp_path):
    model = quantized(tmp_path, draft_layers=[1, 2], draft_vocab_size=32)
    model.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(head_token_ids(reloaded), head_token_ids(model))
    ids = char_tokenizer()("hello hello hello", return_tensors="pt").input_ids
    a = model.generate(ids, max_new_tokens=12, do_sample=False, quasar={"drafter": "self_reduced"})
    b = reloaded.generate(ids, max_new_tokens=12, do_sample=False, quasar={"drafter": "self_reduced"})
    assert torch.equal(a, b)
    assert torch.equal(a, reloaded.generate(ids, max_new_tokens=12, do_sample=False, quasar=False))


def test_sampled_draft_distribution_is_zero_outside_the_subset(tmp_path):
    model = quantized(tmp_path, draft_layers=[0, 3], draft_vocab_size=40)
    drafter = DRAFTER_FACTORIES["self_reduced"](model, QuasarGenerationConfig(drafter="self_reduced", num_draft_tokens=3))
    generator = torch.Generator().manual_seed(0)
    setup = DraftSetup(
        do_sample=True, score_fn=lambda prefixes, logits: logits / 0.7, generator=generator, device=torch.device("cpu")
    )
    prompt = char_tokenizer()("the cat sat", return_tensors="pt").input_ids[0]
    drafter.start([prompt], setup)
    draft = drafter.propose([prompt], [3])
    q = draft.probs[0]  # [3, V]
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    outside = torch.ones(q.shape[-1], dtype=torch.bool)
    outside[head_token_ids(model)] = False
    assert (q[:, outside] == 0).all()
    assert torch.isin(draft.tokens[0], head_token_ids(model)).all()


def test_speculative_sampling_stays_exact_with_a_subset_draft_distribution():
    """q supported on a subset only: the first emitted token is still distributed as p."""
    n = 200_000
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.50, 0.20, 0.30, 0.0, 0.0, 0.0])  # zeros outside the draft head's tokens {0, 1, 2}
    generator = torch.Generator().manual_seed(1)
    draft_tokens = torch.multinomial(q.expand(n, 6), 1, replacement=True, generator=generator)  # [n, 1]
    target = p.expand(n, 2, 6).contiguous()
    num_accepted, next_token = speculative_sample_accept(draft_tokens, q.expand(n, 1, 6).contiguous(), target, generator)
    first = torch.where(num_accepted > 0, draft_tokens[:, 0], next_token)
    empirical = torch.bincount(first, minlength=6).double() / n
    assert (empirical - p.double()).abs().max() < 0.006  # ~6 standard errors at n = 200k


def test_draft_bytes_per_token_counts_head_rows(tmp_path):
    model = quantized(tmp_path, draft_layers=[0, 3], draft_dtype="int8", draft_vocab_size=32)
    reduced = draft_bytes_per_token(model)
    full = draft_bytes_per_token(model, reduced=False)
    row = 64 * 4  # hidden 64, fp32 head
    assert reduced["draft_head_bytes"] == 32 * row and full["draft_head_bytes"] == 128 * row
    assert reduced["draft_layer_bytes"] == full["draft_layer_bytes"] > 0
    assert reduced["draft_bytes_per_token"] < full["draft_bytes_per_token"] < full["verify_bytes_per_step"]


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="draft_layers"):
        QuasarConfig(draft_vocab_size=100)
    with pytest.raises(ValueError, match="positive integer"):
        QuasarConfig(draft_layers=[0], draft_vocab_size=0)
    model = quantized(tmp_path, draft_layers=[0, 3])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        reduced_self_draft_model(model)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        quantized(tmp_path, draft_layers=[0], draft_vocab_size=1000)
