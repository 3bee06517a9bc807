"""Calibration data: turn a dataset, a file, a dataset name or a list of strings into token blocks.

The offline default is the English text of Python's own documentation topics, shipped with
every CPython in `pydoc_data.topics` (PSF licence). Topics are split in two by a stable hash:
the "calibration" half calibrates, the "heldout" half is left for evaluation (perplexity).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterable

import torch

BUILTIN_NAME = "builtin:python-docs"
MIN_BLOCK_TOKENS = 16
_TEXT_COLUMNS = ("text", "content", "prompt", "document", "article")


def builtin_texts(split: str = "calibration") -> list[str]:
    """Python documentation topics (offline), split by a stable hash into calibration / heldout."""
    if split not in ("calibration", "heldout"):
        raise ValueError(f"split must be 'calibration' or 'heldout', got {split!r}")
    from pydoc_data.topics import topics

    want = 0 if split == "calibration" else 1
    keys = sorted(k for k in topics if hashlib.sha256(k.encode()).digest()[0] % 2 == want)
    return [topics[k] for k in keys]


def _texts_from_dataset(dataset, text_column: str | None) -> list[str]:
    """Pull one string column out of a `datasets.Dataset`."""
    columns = list(dataset.column_names)
    column = text_column or next((c for c in _TEXT_COLUMNS if c in columns), None)
    if column is None or column not in columns:
        raise ValueError(
            f"calibration dataset has no text column {text_column or _TEXT_COLUMNS!r}; its columns are "
            f"{columns}. Pass QuasarConfig(calibration_text_column=...)."
        )
    return [t for t in dataset[column] if isinstance(t, str)]


def load_calibration_texts(source, text_column: str | None = None, split: str = "train") -> tuple[list[str], str]:
    """(texts, description) from None | list[str] | datasets.Dataset | local file | hub dataset name."""
    if source is None or source == BUILTIN_NAME:
        return builtin_texts("calibration"), BUILTIN_NAME
    if isinstance(source, (list, tuple)):
        if not all(isinstance(t, str) for t in source):
            raise TypeError("a calibration list must hold strings")
        return list(source), f"list of {len(source)} strings"
    if hasattr(source, "column_names"):
        return _texts_from_dataset(source, text_column), f"datasets.Dataset ({len(source)} rows)"
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"calibration_dataset must be None, a list of strings, a datasets.Dataset, a file path or a dataset "
            f"name; got {type(source).__name__}"
        )
    source = str(source)
    import datasets

    if os.path.exists(source):
        ext = source.rsplit(".", 1)[-1].lower()
        if ext == "txt":
            with open(source, encoding="utf-8") as fh:
                paragraphs = [p for p in fh.read().split("\n\n") if p.strip()]
            return paragraphs, f"file {os.path.basename(source)}"
        builder = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv"}.get(ext)
        if builder is None:
            raise ValueError(f"unsupported calibration file type {ext!r}: use .txt, .json, .jsonl, .parquet or .csv")
        dataset = datasets.load_dataset(builder, data_files=source, split="train")
        return _texts_from_dataset(dataset, text_column), f"file {os.path.basename(source)}"
    try:
        dataset = datasets.load_dataset(source, split=split)
    except Exception as err:  # network down, unknown name, ...: say what to do instead
        raise ValueError(
            f"could not load calibration dataset {source!r} ({type(err).__name__}: {err}). Pass a local "
            f"json/jsonl/parquet/txt file, a list of strings, or leave calibration_dataset=None for the offline "
            f"default ({BUILTIN_NAME})."
        ) from None
    return _texts_from_dataset(dataset, text_column), f"dataset {source}"


def build_calibration_blocks(texts: Iterable[str], tokenizer, num_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """Token blocks [num_blocks, seq_len'] for calibration.

    Texts are tokenized, joined with EOS and cut into `seq_len` blocks; `num_samples` blocks are
    drawn at random (fixed seed). Fewer blocks than asked: all of them, with a warning. A tail
    shorter than `seq_len` is used only if no full block exists.
    """
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise ValueError("calibration data is empty: give at least one non-empty text")
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + sep)
        if len(stream) >= num_samples * seq_len * 4:  # plenty to sample from
            break
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
