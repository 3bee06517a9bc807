"""Quasar is a Quasar checkpoint's default decoding: saved in its generation config, changed per call
through a GenerationConfig (what `transformers serve` requests send), off with quasar=False; a default
that meets an option the loop does not implement falls back to plain decoding, an explicit request raises."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer, TextStreamer

from quasar_hf.detect import plain_decoding
from quasar_hf.speculative.defaults import log_declined
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
    [dict(output_scores=True, return_dict_in_generate=True), dict(num_beams=2)],
    ids=["output_scores", "beam_search"],
)
def test_unsupported_options_fall_back_by_default_and_raise_when_asked(model, options, caplog):
    log_declined.cache_clear()  # logged once per reason and process: an earlier test may have logged it
    with caplog.at_level(logging.INFO, logger="quasar_hf.speculative.defaults"):
        out = model.generate(IDS, max_new_tokens=6, do_sample=False, **options)
    sequences = out.sequences if hasattr(out, "sequences") else out
    assert getattr(out, "quasar_stats", None) is None and sequences.shape[1] == IDS.shape[1] + 6
    assert "plain decoding instead of the default Quasar decoding" in caplog.text
    with pytest.raises(ValueError):
        model.generate(IDS, max_new_tokens=6, do_sample=False, quasar=True, **options)


class _RecordingStreamer(BaseStreamer):
    """A generic streamer (no put_row): what plain generate gives it, call by call."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", value.tolist()))

    def end(self):
        self.calls.append(("end", None))


def test_a_generic_streamer_over_a_batch_gets_what_plain_generate_gives_it(model):
    """quasar=True (and the default) take a BaseStreamer over a batch as plain generate does: the prompts, then one
    [B] tensor per new position (a finished row's pad_token_id after its end), then end(). One row stops early here."""
    ids = torch.stack([IDS[0], torch.tensor([9, 8, 7, 6, 5, 9, 8, 7, 6, 5, 9, 8])])
    free = model.generate(ids, max_new_tokens=10, do_sample=False, quasar=False, eos_token_id=None, pad_token_id=0)
    new = free[:, ids.shape[1] :].tolist()
    stop = next(t for j, t in enumerate(new[0][:6]) if t not in new[1][: j + 3])  # ends row 0 early, row 1 later or never
    options = dict(max_new_tokens=10, do_sample=False, eos_token_id=stop, pad_token_id=0)
    plain = _RecordingStreamer()
    expected = model.generate(ids, streamer=plain, quasar=False, **options)
    assert (expected[0, ids.shape[1] :] == 0).any(), "row 0 stopped early"
    for quasar in ({"quasar": True}, {}):
        streamer = _RecordingStreamer()
        out = model.generate(ids, streamer=streamer, return_dict_in_generate=True, **quasar, **options)
        assert out.quasar_stats is not None and torch.equal(out.sequences, expected)
        assert streamer.calls == plain.calls
    for quasar in (False, True):  # TextStreamer refuses a batch itself, on the prompt generate streams
        with pytest.raises(ValueError, match="TextStreamer only supports batch size 1"):
            model.generate(ids, streamer=TextStreamer(None), quasar=quasar, **options)


@pytest.mark.parametrize(
    "value, says", [("yes", "'yes'"), (1, "1"), ({"drafts": 4}, "Unknown quasar option")], ids=["string", "number", "option"]
)
def test_a_bad_quasar_field_in_a_checkpoint_names_the_file_and_is_not_saved_again(saved, tmp_path, value, says):
    """A checkpoint's generation_config.json with `"quasar": "yes"`: the first generate that reads the default says
    which file and field, and what they take (not the keyword quasar=, which the caller never passed); quasar=False
    still decodes; save_pretrained refuses to write the value back until it is fixed."""
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(saved, folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "quasar": value}))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with pytest.raises(ValueError) as raised:
        model.generate(IDS, max_new_tokens=4, do_sample=False)
    message = str(raised.value)
    assert str(folder / "generation_config.json") in message and '"quasar"' in message and says in message
    assert "true, false or an object of Quasar options" in message and "quasar=" not in message
    assert model.generate(IDS, max_new_tokens=4, do_sample=False, quasar=False).shape[1] == IDS.shape[1] + 4
    with pytest.raises(ValueError, match="generation_config.json"):
        model.save_pretrained(tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    model.generation_config.quasar = False
    model.save_pretrained(tmp_path / "copy")
    assert json.loads((tmp_path / "copy" / "generation_config.json").read_text())["quasar"] is False


def test_a_bad_quasar_field_in_a_passed_generation_config_says_so(model):
    config = GenerationConfig(quasar="yes", max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match=r"the generation_config passed to generate: its field \"quasar\" is 'yes'"):
        model.generate(IDS, generation_config=config)
