"""Calibration data at the edges: one huge text is tokenized only as far as needed, and errors
describe a bad value by type and length, never by echoing it."""

from __future__ import annotations

import pytest

from quasar_hf.smoothquant.data import CHUNK_CHARS, build_calibration_blocks, load_calibration_texts
from tests.helpers.tiny_models import char_tokenizer

HUGE_CHARS = 21_000_000


class CountingTokenizer:
    """A real tokenizer that records how many characters it was asked to tokenize."""

    def __init__(self) -> None:
        self.inner = char_tokenizer()
        self.eos_token_id = self.inner.eos_token_id
        self.chars = 0

    def __call__(self, text: str, add_special_tokens: bool = False):
        self.chars += len(text)
        return self.inner(text, add_special_tokens=add_special_tokens)


@pytest.fixture(scope="module")
def huge_text() -> str:
    sentence = "the quick brown fox jumps over the lazy dog\n"
    return sentence * (HUGE_CHARS // len(sentence))


def test_one_huge_text_is_tokenized_only_as_far_as_needed(huge_text):
    tokenizer = CountingTokenizer()
    blocks = build_calibration_blocks([huge_text], tokenizer, num_samples=4, seq_len=64)
    assert tuple(blocks.shape) == (4, 64)
    needed = 4 * 64 * 4  # the blocks are drawn from 4x the tokens they hold (1 token per char here)
    assert tokenizer.chars <= needed + CHUNK_CHARS  # not the 21 million characters of the text


def test_pieces_join_back_to_the_text_and_cut_before_spaces():
    tokenizer = CountingTokenizer()
    text = "alpha beta gamma delta " * 200
    with pytest.warns(UserWarning, match="holds only"):  # all of the text is used
        blocks = build_calibration_blocks([text], tokenizer, num_samples=1000, seq_len=16, chunk_chars=50)
    whole = tokenizer.inner(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert blocks.flatten().tolist() == whole[: blocks.numel()]  # a char tokenizer: cuts change nothing
    assert tokenizer.chars == len(text)


def test_a_bare_string_gets_a_short_error_without_the_text(huge_text):
    with pytest.raises(ValueError) as error:
        load_calibration_texts(huge_text)
    message = str(error.value)
    assert len(message) < 400 and "quick brown" not in message
    assert f"str of length {len(huge_text)}" in message and "[text]" in message
    with pytest.raises(ValueError, match="list of strings"):
        load_calibration_texts("two words")  # text, not a name: no dataset lookup
    with pytest.raises(TypeError) as error:
        build_calibration_blocks(huge_text, CountingTokenizer(), num_samples=1, seq_len=16)
    assert len(str(error.value)) < 400 and "[text]" in str(error.value)


def test_wrong_types_are_described_not_echoed():
    secret = "x" * 100_000
    with pytest.raises(TypeError) as error:
        load_calibration_texts(["fine", secret.encode()])
    assert "bytes of length 100000" in str(error.value) and "xxx" not in str(error.value)
    with pytest.raises(TypeError) as error:
        build_calibration_blocks(["fine", 42], CountingTokenizer(), num_samples=1, seq_len=16)
    assert "int" in str(error.value)
