"""The shipped calibration / held-out text (builtin:mix-v1): bounded, licensed, disjoint halves, chat templates."""

from __future__ import annotations

import gzip
import json
from importlib import resources

import pytest

from quasar_hf.smoothquant.builtin_text import (
    KINDS,
    MIX_NAME,
    PYTHON_DOCS_NAME,
    mix_items,
    mix_texts,
    python_docs_texts,
    render_conversation,
)
from quasar_hf.smoothquant.data import build_calibration_blocks, load_calibration_texts
from tests.helpers.tiny_models import char_tokenizer


def _file(split: str):
    return resources.files("quasar_hf") / "data" / "calibration" / f"mix-v1-{split}.jsonl.gz"


@pytest.mark.parametrize("split", ["calibration", "heldout"])
def test_each_half_is_bounded_licensed_and_holds_every_kind(split):
    with _file(split).open("rb") as fh:
        assert len(fh.read()) < 200_000  # bounded: ships in the wheel
    items = mix_items(split)
    assert {i["kind"] for i in items} == set(KINDS)
    assert all(i["origin"] and i["licence"] in ("PSF-2.0", "BSD-3-Clause (Gunther Cox)") for i in items)
    first = [i["kind"] for i in items[:30]]  # interleaved: a short prefix already holds all three kinds
    assert set(first) == set(KINDS)


def test_the_halves_share_no_text():
    def pieces(split):
        out = set()
        for item in mix_items(split):
            if item["kind"] == "chat":
                out.update(json.dumps(turns) for turns in item["conversations"])
            else:
                out.add(item["text"])
        return out

    assert not pieces("calibration") & pieces("heldout")
    assert not set(python_docs_texts("calibration")) & set(python_docs_texts("heldout"))


def test_chat_is_rendered_with_the_chat_template_when_there_is_one():
    class Templated:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, messages, tokenize=False):
            assert tokenize is False
            return "".join(f"<|{m['role']}|>{m['content']}" for m in messages)

    assert render_conversation(["hi", "hello", "bye"], Templated()) == "<|user|>hi<|assistant|>hello<|user|>bye"
    assert render_conversation(["hi", "hello"], char_tokenizer()) == "User: hi\nAssistant: hello"
    chat = mix_texts("heldout", ("chat",), Templated())
    assert chat and all(t.startswith("<|user|>") for t in chat)
    with pytest.raises(ValueError, match="unknown text kinds"):
        mix_texts("heldout", ("poetry",))


def test_default_and_named_builtin_sources():
    texts, source = load_calibration_texts(None)
    assert source == MIX_NAME and texts == mix_texts("calibration")
    texts, source = load_calibration_texts(PYTHON_DOCS_NAME)
    assert source == PYTHON_DOCS_NAME and texts == python_docs_texts("calibration")
    blocks = build_calibration_blocks(mix_texts("calibration"), char_tokenizer(), 32, 512)
    assert blocks.shape == (32, 512)  # the default calibration size fits in the shipped text
    with pytest.raises(ValueError, match="split must be"):
        mix_items("train")


def test_shipped_files_are_plain_gzip_jsonl():
    with _file("heldout").open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as fh:
        first = json.loads(fh.readline())
    assert set(first) >= {"kind", "origin", "licence"}
