"""The index of reports, made from the report files: `python -m benchmarks.index` writes benchmarks/reports/README.md.

A report is the files of one stem in `benchmarks/reports/<measurement>/` (NAME.json, NAME.md, and plots
NAME_*.png). Its row comes from the files themselves: the markdown's first heading; an index block
(`<!-- index: {JSON} -->` in the markdown, or `index` in the JSON: `summary`, `command`, `machine`,
`commit`, `date`, what the earlier, hand-kept index recorded) where there is one, else the JSON's
`command` and environment block (`cpu`, `git_commit`, `date`) and the markdown's `Command:` line. `tests/test_docs_current.py` checks that the committed
index is the one these files make.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from benchmarks import REPORTS

INDEX = REPORTS / "README.md"
HEADER = """# Index of reports

Made by `python -m benchmarks.index` from the report files (do not edit by hand). One section per
measurement (`python -m benchmarks <measurement>`), one row per report (the files sharing a stem).
Machines: `Xeon AMX`, `Xeon VNNI+BF16`, `EPYC Zen 4` (AVX-512 VNNI), `EPYC Zen 3 AVX2`; a CPU model
name where the report gives only that. Compare ratios measured side by side in one report, never
absolute numbers across reports: the machines are shared and drift.
"""


def report_stems(folder: Path) -> dict[str, list[Path]]:
    """stem -> its files (a plot NAME_x.png joins the report NAME)."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    stems = sorted({p.stem for p in files if p.suffix in (".md", ".json")}, key=len, reverse=True)
    grouped: dict[str, list[Path]] = {stem: [] for stem in stems}
    for path in files:
        owner = path.stem if path.stem in grouped else next((s for s in stems if path.stem.startswith(s + "_")), None)
        if owner is not None:
            grouped[owner].append(path)
    return dict(sorted(grouped.items()))


def describe(files: list[Path]) -> dict[str, str]:
    """A report's row: title, summary, command, machine, commit, date (what its files say; "-" when none)."""
    md = next((p for p in files if p.suffix == ".md"), None)
    data = _json(next((p for p in files if p.suffix == ".json"), None))
    text = md.read_text(errors="replace") if md else ""
    heading = re.search(r"^# (.+)$", text, flags=re.M)
    env = data.get("environment") if isinstance(data.get("environment"), dict) else {}
    comment = re.search(r"^<!-- index: (\{.*\}) -->$", text, flags=re.M)
    recorded = json.loads(comment.group(1)) if comment else data.get("index") if isinstance(data.get("index"), dict) else {}
    command = recorded.get("command") or data.get("command") or _md_command(text)
    return {
        "title": heading.group(1).strip() if heading else "-",
        "summary": recorded.get("summary", ""),
        "command": _one_line(command) if isinstance(command, str) else "-",
        "machine": recorded.get("machine") or env.get("cpu") or "-",
        "commit": recorded.get("commit") or (env.get("git_commit") or "")[:7] or "-",
        "date": recorded.get("date") or env.get("date") or "-",
    }


def _json(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _md_command(text: str) -> str | None:
    match = re.search(r"^(?:Command: |Reproduce: )?`((?:python|quasar-hf|benchmarks/)[^`]+)`", text, flags=re.M)
    return match.group(1) if match else None


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def index_text() -> str:
    """benchmarks/reports/README.md as the report files make it."""
    lines = [HEADER]
    for folder in sorted(p for p in REPORTS.iterdir() if p.is_dir()):
        lines += [f"## {folder.name}", "", "| report | what | command | machine | commit | date |", "|---|---|---|---|---|---|"]
        for stem, files in report_stems(folder).items():
            row = describe(files)
            what = row["title"] + (f": {row['summary']}" if row["summary"] else "")
            kinds = ",".join(sorted({p.suffix.lstrip(".") for p in files}))
            command = row["command"].replace("`", "")
            cells = [f"`{stem}.{{{kinds}}}`", _one_line(what), f"`{command}`" if command != "-" else "-"]
            lines.append("| " + " | ".join([*cells, row["machine"], row["commit"], row["date"]]) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    INDEX.write_text(index_text())
    print(f"wrote {INDEX}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
