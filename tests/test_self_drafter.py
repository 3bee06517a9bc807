"""drafter="self": the dual-precision draft path drafting for W8A8 verification (tiny 4-layer models)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig, QuasarGenerationConfig
from tests.helpers.tiny_models import char_tokenizer, tiny_model

FAST = dict(num_calibration_samples=4, calibration_seq_len=64)


def quantized(tmp_path, **kwargs):
    tiny_model("llama", layers=4, seed=3).save_pretrained(tmp_path / "src")
    char_tokenizer().save_pretrained(tmp_path / "src")
    return AutoModelForCausalLM.from_pretrained(
        tmp_path / "src", quantization_config=QuasarConfig(**FAST, **kwargs), dtype=torch.float32
    )


@pytest.mark.parametrize("draft_dtype", ["model", "int8"])
def test_self_draft_greedy_equals_plain_greedy(tmp_path, draft_dtype):
    model = quantized(tmp_path, draft_layers=[0, 3], draft_dtype=draft_dtype)
    tok = char_tokenizer()
    for text in ["the cat sat on the mat; the cat sat on the", "abcabcabcabc", "def f(x): return x + 1\ndef g(x"]:
        ids = tok(text, return_tensors="pt").input_ids
        plain = model.generate(ids, max_new_tokens=24, do_sample=False, quasar=False)
        out = model.generate(
            ids, max_new_tokens=24, do_sample=False, quasar=QuasarGenerationConfig(drafter="self"), return_dict_in_generate=True
        )
        assert torch.equal(out.sequences, plain)
        assert out.quasar_stats.drafted_tokens > 0


def test_self_draft_survives_save_and_reload(tmp_path):
    model = quantized(tmp_path, draft_layers=[1, 2])
    model.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = char_tokenizer()("hello hello hello", return_tensors="pt").input_ids
    a = model.generate(ids, max_new_tokens=12, do_sample=False, quasar={"drafter": "self"})
    b = reloaded.generate(ids, max_new_tokens=12, do_sample=False, quasar={"drafter": "self"})
    assert torch.equal(a, b)


def test_self_draft_without_draft_path_is_a_clear_error(tmp_path):
    model = quantized(tmp_path)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"draft_layers"):
        model.generate(ids, max_new_tokens=4, quasar={"drafter": "self"})
