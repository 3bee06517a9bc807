"""Quasar decoding as Transformers' custom generation strategy, and no patched Transformers classes.

`custom_generate=quasar_hf.generate` (the callable), `custom_generate="hub/quasar-generate"` (the
Hub-ready folder) and `generate(quasar=True)` on a Quasar model all equal plain greedy generate;
`import quasar_hf` and loading a Quasar model leave GenerationMixin.generate,
PreTrainedModel.save_pretrained and PreTrainedModel.push_to_hub as Transformers defined them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import quasar_hf
from quasar_hf.speculative import QuasarGenerationConfig
from quasar_hf.speculative.left_padding import left_padded
from tests.helpers.tiny_models import save_tiny, tiny_model

HUB_FOLDER = Path(__file__).resolve().parents[1] / "hub" / "quasar-generate"


def prompt(seed=0, length=20):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 90, (length,), generator=g)
    return torch.cat([base, base[: length // 2]])[None]


@pytest.mark.parametrize("quasar", [True, {"drafter": "ngram", "num_draft_tokens": 3}])
def test_callable_strategy_equals_plain_greedy_on_a_stock_model(quasar):
    model = tiny_model()
    ids = prompt()
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    out = model.generate(
        ids, max_new_tokens=24, do_sample=False, custom_generate=quasar_hf.generate, quasar=quasar, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, plain) and out.quasar_stats.verify_steps > 0


def test_callable_strategy_takes_transformers_processors_and_batches():
    model = tiny_model()
    rows = [prompt(0), prompt(1, 12)]
    ids, mask = left_padded(rows, pad=96)
    options = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, repetition_penalty=1.5, no_repeat_ngram_size=3)
    plain = model.generate(ids, **options)
    assert torch.equal(model.generate(ids, custom_generate=quasar_hf.generate, **options), plain)


def test_hub_folder_form_runs_with_streamer_and_stop_strings():
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from quasar_hf.models import smollm2_135m_instruct

    tokenizer = AutoTokenizer.from_pretrained(smollm2_135m_instruct())
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer),
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = tokenizer("The cat sat on the mat. The cat sat on the mat. The cat", return_tensors="pt").input_ids
    free = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None)
    stop = tokenizer.decode(free[0, ids.shape[1] + 5 : ids.shape[1] + 7])
    options = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer)
    plain = model.generate(ids, **options)
    chunks = []

    class Streamer:
        def put(self, value):
            chunks.append(value.reshape(-1))

        def end(self):
            chunks.append(None)

    out = model.generate(
        ids, custom_generate=str(HUB_FOLDER), trust_remote_code=True, streamer=Streamer(), quasar=True, **options
    )
    assert torch.equal(out, plain) and plain.shape[1] < free.shape[1]
    assert torch.equal(chunks[0], ids[0]) and chunks[-1] is None
    assert torch.equal(torch.cat(chunks[1:-1]), out[0, ids.shape[1] :])


def test_hub_folder_is_hub_ready():
    readme = (HUB_FOLDER / "README.md").read_text()
    front_matter = readme.split("---")[1]
    assert "custom_generate" in front_matter
    assert "quasar-hf" in (HUB_FOLDER / "custom_generate" / "requirements.txt").read_text()


def test_strategy_refuses_what_it_does_not_implement():
    model = tiny_model()
    with pytest.raises(ValueError, match="beam search"):
        model.generate(prompt(), num_beams=2, max_new_tokens=4, custom_generate=quasar_hf.generate)
    with pytest.raises(ValueError, match="Unknown quasar option"):
        model.generate(prompt(), max_new_tokens=4, custom_generate=quasar_hf.generate, quasar={"nope": 1})


@pytest.fixture(scope="module")
def quasar_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = save_tiny(tmp_path_factory.mktemp("tiny"))
    config = quasar_hf.QuasarConfig(alpha=0.5, num_calibration_samples=2, calibration_seq_len=32, weight_rounding="nearest")
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config).eval()


def test_quasar_model_generate_equals_the_strategy(quasar_model):
    ids = prompt()
    plain = quasar_model.generate(ids, max_new_tokens=20, do_sample=False, quasar=False)
    assert torch.equal(quasar_model.generate(ids, max_new_tokens=20, do_sample=False, quasar=True), plain)
    assert torch.equal(quasar_model.generate(ids, max_new_tokens=20, do_sample=False, quasar=QuasarGenerationConfig()), plain)
    by_strategy = quasar_model.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=quasar_hf.generate)
    assert torch.equal(by_strategy, plain)


def test_transformers_classes_are_never_patched(quasar_model, tmp_path):
    """Checked in a fresh interpreter: the three class attributes before import, after import and after loading."""
    folder = save_tiny(tmp_path / "tiny")
    script = f"""
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.generation.utils import GenerationMixin
originals = (GenerationMixin.generate, PreTrainedModel.save_pretrained, PreTrainedModel.push_to_hub)
current = lambda: (GenerationMixin.generate, PreTrainedModel.save_pretrained, PreTrainedModel.push_to_hub)
stock = AutoModelForCausalLM.from_pretrained({folder!r}).eval()
ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
before = stock.generate(ids, max_new_tokens=8, do_sample=False)
import quasar_hf
assert current() == originals, "import quasar_hf patched a Transformers class"
config = quasar_hf.QuasarConfig(alpha=0.5, num_calibration_samples=2, calibration_seq_len=32, weight_rounding="nearest")
quasar = AutoModelForCausalLM.from_pretrained({folder!r}, quantization_config=config)
assert current() == originals, "loading a Quasar model patched a Transformers class"
assert "generate" not in vars(stock) and "save_pretrained" not in vars(stock)
assert torch.equal(stock.generate(ids, max_new_tokens=8, do_sample=False), before)
try:
    stock.generate(ids, max_new_tokens=8, quasar=True)
except ValueError as error:
    assert "quasar" in str(error)
else:
    raise AssertionError("a stock model accepted quasar=True")
assert quasar.generate(ids, max_new_tokens=8, do_sample=False, quasar=True).shape[1] == 15
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_reloaded_quasar_model_is_bound_again(quasar_model, tmp_path):
    from transformers import AutoModelForCausalLM

    quasar_model.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").exists()  # the bound save_pretrained wrote the card
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = prompt()
    plain = reloaded.generate(ids, max_new_tokens=12, do_sample=False, quasar=False)
    out = reloaded.generate(ids, max_new_tokens=12, do_sample=False, quasar=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and out.quasar_stats is not None
