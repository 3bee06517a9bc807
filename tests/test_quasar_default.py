"""Quasar is a Quasar checkpoint's default decoding: saved in its generation config, changed per call
through a GenerationConfig (what `transformers serve` requests send), off with quasar=False; a default
that meets an option the loop does not implement falls back to plain decoding, an explicit request raises."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from quasar_hf.detect import plain_decoding
from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny

IDS = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quasar")
    quantize_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("base"))).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model(saved):
    return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)


def test_the_checkpoint_says_quasar_is_on_and_generate_uses_it(saved, model):
    assert json.loads((saved / "generation_config.json").read_text())["quasar"] is True
    out = model.generate(IDS, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert out.quasar_stats is not None and out.quasar_stats.verify_steps > 0
    plain = model.generate(IDS, max_new_tokens=12, do_sample=False, quasar=False)
    assert torch.equal(out.sequences, plain)
    assert plain_decoding(model) == {"quasar": False}


@pytest.mark.parametrize(
    "request_config, quasar_runs",
    [({"quasar": False}, False), ({"quasar": {"num_draft_tokens": 2}}, True), ({}, True)],
    ids=["off", "options", "unset"],
)
def test_a_request_generation_config_changes_or_turns_off_the_default(model, request_config, quasar_runs):
    config = GenerationConfig(**json.loads(json.dumps({**request_config, "max_new_tokens": 10, "do_sample": False})))
    out = model.generate(IDS, generation_config=config, return_dict_in_generate=True)
    assert (getattr(out, "quasar_stats", None) is not None) == quasar_runs
    assert torch.equal(out.sequences, model.generate(IDS, max_new_tokens=10, do_sample=False, quasar=False))


def test_a_checkpoint_saved_with_quasar_off_decodes_plainly(model, tmp_path):
    model.generation_config.quasar = False  # what a user edits, or `GenerationConfig(quasar=False).save_pretrained(...)`
    try:
        model.save_pretrained(tmp_path / "off")
    finally:
        model.generation_config.quasar = True
    assert json.loads((tmp_path / "off" / "generation_config.json").read_text())["quasar"] is False
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "off", dtype=torch.float32)
    out = reloaded.generate(IDS, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    assert getattr(out, "quasar_stats", None) is None


@pytest.mark.parametrize(
    "options",
    [dict(output_scores=True, return_dict_in_generate=True), dict(num_beams=2), dict(streamer="batch")],
    ids=["output_scores", "beam_search", "streamer-over-a-batch"],
)
def test_unsupported_options_fall_back_by_default_and_raise_when_asked(model, options, caplog):
    ids = IDS
    if options.get("streamer") == "batch":
        ids, options = IDS.repeat(2, 1), {"streamer": _BatchStreamer()}
    with caplog.at_level(logging.INFO, logger="quasar_hf.speculative.defaults"):
        out = model.generate(ids, max_new_tokens=6, do_sample=False, **options)
    sequences = out.sequences if hasattr(out, "sequences") else out
    assert getattr(out, "quasar_stats", None) is None and sequences.shape[1] == ids.shape[1] + 6
    assert "plain decoding instead of the default Quasar decoding" in caplog.text or options.get("streamer")
    with pytest.raises(ValueError):
        model.generate(ids, max_new_tokens=6, do_sample=False, quasar=True, **options)


class _BatchStreamer:
    """A streamer that takes every row (plain generate streams batches to such a streamer)."""

    def put(self, value):
        pass

    def end(self):
        pass
