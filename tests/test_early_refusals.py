"""Inputs that used to fail late or pass silently, each now taken or refused up front by name: int32
token ids (taken, as plain generate takes them), inputs_embeds with quasar=True, calibration blocks
shorter than statistics need or longer than the model's context, a non-integer seed, an unknown
built-in calibration text."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig
from quasar_hf.smoothquant.data import load_calibration_texts
from tests.helpers.tiny_models import save_tiny


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory.mktemp("src"), "llama", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def model(source):
    config = QuasarConfig(num_calibration_samples=4, calibration_seq_len=32)
    return AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16)


def test_int32_token_ids_decode_as_plain_generate_decodes_them(model):
    base = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(1))
    ids = torch.cat([base, base[:10]])[None].to(torch.int32)
    plain = model.generate(ids, max_new_tokens=10, do_sample=False, quasar=False)
    spec = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, quasar=True, return_dict_in_generate=True)
    assert spec.quasar_stats.verify_steps > 0
    assert spec.sequences.dtype == plain.dtype and torch.equal(spec.sequences, plain)


def test_inputs_embeds_with_quasar_is_refused_before_any_forward(model):
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        embeds = model.get_input_embeddings()(torch.tensor([[1, 2, 3]]))
        with pytest.raises(ValueError, match="needs the prompt as input_ids; inputs_embeds is not supported"):
            model.generate(inputs_embeds=embeds, max_new_tokens=4, quasar=True)
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize(
    "seq_len, message",
    [(1, r"calibration_seq_len=1 is too short.*at least 16 tokens"), (513, r"longer than the model's context \(512 tokens")],
)
def test_calibration_blocks_too_short_or_past_the_context_are_refused(source, seq_len, message):
    config = QuasarConfig(num_calibration_samples=2, calibration_seq_len=seq_len)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16)


@pytest.mark.parametrize("seed", ["x", 1.5, -1, True])
def test_a_seed_that_is_not_a_non_negative_integer_is_refused_at_once(seed):
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        QuasarConfig(seed=seed)


def test_an_unknown_builtin_text_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"no built-in calibration text is named 'builtin:nope'.*builtin:mix-v1"):
        load_calibration_texts("builtin:nope")
