"""Calibration data: turn a dataset, a file, a dataset name or a list of strings into token blocks.

The offline default, "builtin:mix-v1", is prose, code and chat shipped with quasar_hf; its other
half is held out for fidelity measurements (smoothquant/builtin_text.py).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator

import torch

from quasar_hf.smoothquant.builtin_text import BUILTIN_SOURCES, MIX_NAME, python_docs_texts
from quasar_hf.smoothquant.builtin_text import builtin_texts as builtin_source_texts

BUILTIN_NAME = MIX_NAME  # the default calibration text
MIN_BLOCK_TOKENS = 16
CHUNK_CHARS = 16_384  # characters tokenized per call: bounds the memory of one huge text
MAX_NAME_CHARS = 300  # a longer str is text, not a file path or dataset name
_TEXT_COLUMNS = ("text", "content", "prompt", "document", "article")


def builtin_texts(split: str = "calibration") -> list[str]:
    """The previous default text, Python documentation topics, in halves (fidelity reports keep using it)."""
    return python_docs_texts(split)


def _texts_from_dataset(dataset, text_column: str | None) -> list[str]:
    """Pull one string column out of a `datasets.Dataset`."""
    columns = list(dataset.column_names)
    column = text_column or next((c for c in _TEXT_COLUMNS if c in columns), None)
    if column is None or column not in columns:
        wanted = repr(text_column) if text_column else f"(looked for {', '.join(_TEXT_COLUMNS)})"
        raise ValueError(
            f"calibration dataset has no text column {wanted}; its columns are {columns}. Name the column: "
            "`quasar-hf quantize ... --text-column NAME`, or QuasarConfig(calibration_text_column=NAME) in Python."
        )
    return [t for t in dataset[column] if isinstance(t, str)]


def _describe(value) -> str:
    """A value's type and size for error messages (never its content: it may be megabytes of user text)."""
    size = f" of length {len(value)}" if hasattr(value, "__len__") else ""
    return f"a {type(value).__name__}{size}"


def _could_be_a_name(source: str) -> bool:
    """A dataset name or path is one short line without spaces; a long or multi-line str is text."""
    return 0 < len(source) <= MAX_NAME_CHARS and not any(c.isspace() for c in source)


def load_calibration_texts(source, text_column: str | None = None, split: str = "train", tokenizer=None) -> tuple[list[str], str]:
    """(texts, description) from None | a built-in name | list[str] | datasets.Dataset | local file | hub dataset.

    A str names a built-in text, a file or a dataset; texts themselves go in a list (`[text]`).
    `tokenizer` renders the built-in chat text with the model's chat template.
    """
    if source is None:
        source = BUILTIN_NAME
    if source in BUILTIN_SOURCES:
        return builtin_source_texts(source, "calibration", tokenizer), source
    if isinstance(source, str) and source.startswith("builtin:"):
        raise ValueError(f"no built-in calibration text is named {source!r}; the built-in ones are {sorted(BUILTIN_SOURCES)}")
    if isinstance(source, (list, tuple)):
        wrong = next((t for t in source if not isinstance(t, str)), None)
        if wrong is not None:
            raise TypeError(f"a calibration list must hold strings only; it holds {_describe(wrong)}")
        return list(source), f"list of {len(source)} strings"
    if hasattr(source, "column_names"):
        return _texts_from_dataset(source, text_column), f"datasets.Dataset ({len(source)} rows)"
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"calibration_dataset must be None, a list of strings, a datasets.Dataset, a file path or a dataset "
            f"name; got {_describe(source)}"
        )
    source = str(source)
    if not os.path.exists(source) and not _could_be_a_name(source):
        raise ValueError(
            f"calibration_dataset is {_describe(source)} that is neither an existing file nor a dataset name. "
            "To calibrate on your own text, pass a list of strings: calibration_dataset=[text]."
        )
    import datasets

    if os.path.exists(source):
        ext = source.rsplit(".", 1)[-1].lower()
        if ext == "txt":
            with open(source, encoding="utf-8") as fh:
                paragraphs = [p for p in fh.read().split("\n\n") if p.strip()]
            return paragraphs, f"file {os.path.basename(source)}"
        builder = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv"}.get(ext)
        if builder is None:
            raise ValueError(f"unsupported calibration file type {ext[:20]!r}: use .txt, .json, .jsonl, .parquet or .csv")
        dataset = datasets.load_dataset(builder, data_files=source, split="train")
        return _texts_from_dataset(dataset, text_column), f"file {os.path.basename(source)}"
    try:
        dataset = datasets.load_dataset(source, split=split)
    except Exception as err:  # network down, unknown name, ...: say what to do instead
        reason = (str(err).splitlines() or [""])[0][:200]
        raise ValueError(
            f"could not load calibration dataset {source!r} ({type(err).__name__}: {reason}). Pass a local "
            f"json/jsonl/parquet/txt file, a list of strings, or leave calibration_dataset=None for the offline "
            f"default ({BUILTIN_NAME})."
        ) from None
    return _texts_from_dataset(dataset, text_column), f"dataset {source}"


def _pieces(text: str, chunk_chars: int) -> Iterator[str]:
    """Consecutive slices of `text` of at most about `chunk_chars` characters, cut before a whitespace.

    Tokenizers attach a space to the word after it, so cutting before one keeps words whole; the
    tokens can differ from whole-text tokenization only at these few cuts.
    """
    start, length = 0, len(text)
    while start < length:
        end = min(start + chunk_chars, length)
        if end < length:
            cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
            end = cut if cut > start else end
        yield text[start:end]
        start = end


def build_calibration_blocks(
    texts: Iterable[str], tokenizer, num_samples: int, seq_len: int, seed: int = 0, chunk_chars: int = CHUNK_CHARS
) -> torch.Tensor:
    """Token blocks [num_blocks, seq_len'] for calibration.

    Texts are tokenized, joined with EOS and cut into `seq_len` blocks; `num_samples` blocks are
    drawn at random (fixed seed). Fewer blocks than asked: all of them, with a warning. A tail
    shorter than `seq_len` is used only if no full block exists. Texts are tokenized lazily, in
    slices of about `chunk_chars` characters, and only until 4x the needed tokens are collected,
    so one huge text costs no more than the tokens it gives.
    """
    if isinstance(texts, (str, bytes)):
        raise TypeError(f"texts must be a list of strings, got {_describe(texts)}; wrap a single text in a list: [text]")
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    wanted = num_samples * seq_len * 4  # plenty to sample from
    stream: list[int] = []
    seen_text = False
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"calibration texts must be strings; got {_describe(text)}")
        if not text or text.isspace():
            continue
        seen_text = True
        for piece in _pieces(text, chunk_chars):
            stream.extend(tokenizer(piece, add_special_tokens=False)["input_ids"])
            if len(stream) >= wanted:
                break
        stream.extend(sep)
        if len(stream) >= wanted:
            break
    if not seen_text:
        raise ValueError("calibration data is empty: give at least one non-empty text")
    if len(stream) < MIN_BLOCK_TOKENS:
        raise ValueError(
            f"calibration data is too short: {len(stream)} tokens in all, need at least {MIN_BLOCK_TOKENS}. "
            "Give longer texts or more of them."
        )
    full = len(stream) // seq_len
    if full == 0:
        warnings.warn(
            f"calibration data holds {len(stream)} tokens, less than one block of {seq_len}: using one short block",
            stacklevel=2,
        )
        return torch.tensor([stream], dtype=torch.long)
    blocks = torch.tensor(stream[: full * seq_len], dtype=torch.long).view(full, seq_len)
    if full < num_samples:
        warnings.warn(
            f"asked for {num_samples} calibration samples of {seq_len} tokens but the data holds only {full}; using {full}",
            stacklevel=2,
        )
        return blocks
    generator = torch.Generator().manual_seed(seed)
    pick = torch.randperm(full, generator=generator)[:num_samples]
    return blocks[pick.sort().values]
