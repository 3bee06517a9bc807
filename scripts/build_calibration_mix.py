"""Build the shipped calibration and held-out text (quasar_hf/data/calibration/mix-v1-*.jsonl.gz).

    pip download --no-deps chatterbot-corpus==1.3.3 -d /tmp/cc && unzip -q /tmp/cc/*.whl -d /tmp/cc
    python -m scripts.build_calibration_mix --chatterbot /tmp/cc/chatterbot_corpus

Three kinds of text, each split in two disjoint halves by a stable hash (calibration / heldout):
  prose  Python's documentation topics (`pydoc_data.topics`, PSF-2.0), split by topic;
  code   the Python standard library's top-level modules (PSF-2.0), split by module;
  chat   the English conversations of chatterbot-corpus 1.3.3 (BSD-3-Clause), deduplicated, split by conversation.
Pieces of about PIECE_CHARS characters (cut at blank lines, or line ends for code) are drawn by
content hash, at most PIECES_PER_KIND per kind and split, and interleaved prose, code, chat, ... so
that any prefix of a file is balanced (calibration tokenizes a prefix). Run with CPython 3.11 to
reproduce the shipped files byte for byte.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sysconfig
from pathlib import Path

PIECE_CHARS = 2000
PIECES_PER_KIND = 110
OUT = Path(__file__).resolve().parents[1] / "quasar_hf" / "data" / "calibration"
ORIGINS = {
    "prose": ("CPython 3.11 pydoc_data.topics (Python documentation)", "PSF-2.0"),
    "code": ("CPython 3.11 standard library, top-level modules", "PSF-2.0"),
    "chat": ("chatterbot-corpus 1.3.3, English conversations", "BSD-3-Clause (Gunther Cox)"),
}


def half(key: str) -> str:
    return "calibration" if hashlib.sha256(key.encode()).digest()[0] % 2 == 0 else "heldout"


def pieces(text: str, separator: str) -> list[str]:
    """Consecutive runs of `separator`-joined parts of at most about PIECE_CHARS characters."""
    out, current = [], ""
    for part in text.split(separator):
        if current and len(current) + len(part) > PIECE_CHARS:
            out.append(current)
            current = ""
        current = f"{current}{separator}{part}" if current else part
    if current.strip():
        out.append(current)
    return [p.strip("\n") for p in out if p.strip()]


def disjoint(split: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Drop held-out pieces whose text also occurs in the calibration half (sources repeat a few tables)."""
    seen = {item["text"] for item in split["calibration"]}
    return {"calibration": split["calibration"], "heldout": [i for i in split["heldout"] if i["text"] not in seen]}


def by_hash(items: list, key=lambda item: item) -> list:
    return sorted(items, key=lambda item: hashlib.sha256(json.dumps(key(item)).encode()).hexdigest())[:PIECES_PER_KIND]


def prose_items() -> dict[str, list[dict]]:
    from pydoc_data.topics import topics

    split = {"calibration": [], "heldout": []}
    for key in sorted(topics):
        split[half(key)].extend({"kind": "prose", "text": p} for p in pieces(topics[key], "\n\n"))
    return {name: by_hash(items, lambda i: i["text"]) for name, items in disjoint(split).items()}


def code_items() -> dict[str, list[dict]]:
    split = {"calibration": [], "heldout": []}
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        split[half(path.stem)].extend({"kind": "code", "text": p} for p in pieces(text, "\n\n"))
    return {name: by_hash(items, lambda i: i["text"]) for name, items in disjoint(split).items()}


def chat_items(corpus: Path) -> dict[str, list[dict]]:
    import yaml

    conversations, seen = {"calibration": [], "heldout": []}, set()
    for path in sorted((corpus / "data" / "english").glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        for turns in data.get("conversations") or []:
            turns = [str(t).strip() for t in turns if str(t).strip()]
            key = json.dumps(turns)
            if len(turns) >= 2 and key not in seen:  # the corpus repeats some: a repeat must not cross halves
                seen.add(key)
                conversations[half(key)].append(turns)
    out = {}
    for name, convs in conversations.items():
        items, group, size = [], [], 0
        for turns in sorted(convs, key=lambda t: hashlib.sha256(json.dumps(t).encode()).hexdigest()):
            group.append(turns)
            size += sum(len(t) for t in turns)
            if size >= PIECE_CHARS:
                items.append({"kind": "chat", "conversations": group})
                group, size = [], 0
        if group:
            items.append({"kind": "chat", "conversations": group})
        out[name] = items[:PIECES_PER_KIND]
    return out


def interleave(*kinds: list[dict]) -> list[dict]:
    out = []
    for i in range(max(len(k) for k in kinds)):
        out.extend(k[i] for k in kinds if i < len(k))
    return out


def write(name: str, items: list[dict]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"mix-v1-{name}.jsonl.gz"
    lines = []
    for item in items:
        origin, licence = ORIGINS[item["kind"]]
        lines.append(json.dumps({**item, "origin": origin, "licence": licence}, ensure_ascii=False, sort_keys=True))
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as fh:
        fh.write(("\n".join(lines) + "\n").encode())
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chatterbot", required=True, type=Path, help="the extracted chatterbot_corpus package folder")
    args = parser.parse_args(argv)
    prose, code, chat = prose_items(), code_items(), chat_items(args.chatterbot)
    for name in ("calibration", "heldout"):
        items = interleave(prose[name], code[name], chat[name])
        path = write(name, items)
        counts = {k: sum(1 for i in items if i["kind"] == k) for k in ORIGINS}
        print(f"{path}: {counts}, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
