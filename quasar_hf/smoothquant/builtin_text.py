"""The offline text shipped with quasar_hf: calibration by default, held-out text for fidelity.

"builtin:mix-v1" (the default calibration) is prose, code and conversation, as users run:
  prose  Python's documentation topics (pydoc_data, PSF-2.0);
  code   the Python standard library's modules (PSF-2.0);
  chat   chatterbot-corpus's English conversations (BSD-3-Clause), rendered with the model's own
         chat template when its tokenizer has one (so template tokens are calibrated too).
Each kind is split in two disjoint halves (by topic, module and conversation); calibration reads
one, fidelity measurements the other. The files (data/calibration/, about 140 KB each, built by
scripts/build_calibration_mix.py; NOTICE.md there gives the licences) interleave the kinds, so
any prefix is balanced. "builtin:python-docs" is the previous default: Python's documentation
topics alone, split by topic hash, read from the running CPython.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from functools import lru_cache
from importlib import resources

MIX_NAME = "builtin:mix-v1"
PYTHON_DOCS_NAME = "builtin:python-docs"
BUILTIN_SOURCES = (MIX_NAME, PYTHON_DOCS_NAME)
KINDS = ("prose", "code", "chat")
SPLITS = ("calibration", "heldout")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'calibration' or 'heldout', got {split!r}")


def python_docs_texts(split: str = "calibration") -> list[str]:
    """Python documentation topics (offline), split by a stable hash into calibration / heldout."""
    _check_split(split)
    from pydoc_data.topics import topics

    want = 0 if split == "calibration" else 1
    keys = sorted(k for k in topics if hashlib.sha256(k.encode()).digest()[0] % 2 == want)
    return [topics[k] for k in keys]


@lru_cache(maxsize=2)
def mix_items(split: str = "calibration") -> tuple[dict, ...]:
    """The shipped items of one half, in file order: {"kind", "text" | "conversations", "origin", "licence"}."""
    _check_split(split)
    data = resources.files("quasar_hf") / "data" / "calibration" / f"mix-v1-{split}.jsonl.gz"
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as fh:
        return tuple(json.loads(line) for line in fh if line.strip())


def render_conversation(turns: list[str], tokenizer=None) -> str:
    """Alternating user / assistant turns as the tokenizer's chat template writes them, else as plain lines."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that refuses this shape: plain lines instead
            pass
    return "\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)


def mix_texts(split: str = "calibration", kinds: tuple[str, ...] = KINDS, tokenizer=None) -> list[str]:
    """The texts of one half, of the given kinds, in file order (chat items rendered for `tokenizer`)."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown text kinds {unknown}; choose from {list(KINDS)}")
    texts = []
    for item in mix_items(split):
        if item["kind"] not in kinds:
            continue
        if item["kind"] == "chat":
            texts.append("\n".join(render_conversation(turns, tokenizer) for turns in item["conversations"]))
        else:
            texts.append(item["text"])
    return texts


def builtin_texts(source: str = MIX_NAME, split: str = "calibration", tokenizer=None) -> list[str]:
    """The texts of a built-in source (`BUILTIN_SOURCES`) and half."""
    if source == MIX_NAME:
        return mix_texts(split, KINDS, tokenizer)
    if source == PYTHON_DOCS_NAME:
        return python_docs_texts(split)
    raise ValueError(f"unknown built-in text {source!r}; choose from {list(BUILTIN_SOURCES)}")
