"""The documents match the code: docs/ARCHITECTURE.md names only files and functions that exist and
lists exactly the registered `quasar::` ops, and every figure in the README's result tables is in
the report the table names, rounded as printed."""

from __future__ import annotations

import fnmatch
import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
FILE_NAME = re.compile(r"(?<![\w./{},*-])((?:[\w.-]+/)*[\w{},*-]*\.(?:py|c|h|cpp|sh|md))\b")
NOT_FILES = {"llama.cpp", "convert_hf_to_gguf.py", "NAME.md", "QUASAR_MODEL_CARD.md"}  # other projects, files the tools write


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.split()


def expand_braces(name: str) -> list[str]:
    """`rowstable_linear{,_avx2}.c` -> rowstable_linear.c, rowstable_linear_avx2.c."""
    parts = re.split(r"\{([^}]*)\}", name)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(pick) for pick in itertools.product(*choices)]


def missing_files(text: str, files: list[str]) -> list[str]:
    """File names in `text` that name no tracked file: a bare name must be some file's name, a path
    must end some file's path."""
    basenames = [f.rsplit("/", 1)[-1] for f in files]
    missing = []
    for token in sorted(set(FILE_NAME.findall(text)) - NOT_FILES):
        for name in expand_braces(token.removeprefix("../")):
            if "/" in name:
                found = any(fnmatch.fnmatch(f, name) or fnmatch.fnmatch(f, "*/" + name) for f in files)
            else:
                found = bool(fnmatch.filter(basenames, name))
            if not found:
                missing.append(name)
    return missing


@pytest.mark.parametrize("document", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_every_file_a_document_names_exists(document):
    path = ROOT / document if document == "README.md" else ROOT / "docs" / document
    assert missing_files(path.read_text(), tracked_files()) == []


def test_a_missing_file_is_caught():
    files = tracked_files()
    assert missing_files("see `ops/no_such_kernel.py`, csrc/gone{,_avx2}.c and nothing_*.md", files) == [
        "csrc/gone.c",
        "csrc/gone_avx2.c",
        "nothing_*.md",
        "ops/no_such_kernel.py",
    ]
    assert missing_files("see `ops/torch_ops.py`, csrc/rowstable_linear{,_avx2}.c and quantize_fp32_math_*.md", files) == []


def op_table(text: str) -> list[list[str]]:
    """Rows (cells) of the table under '### The op table'."""
    section = text.split("### The op table", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `quasar::")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_the_op_table_lists_exactly_the_registered_ops_and_their_cpp_implementations():
    import quasar_hf.ops.torch_ops  # noqa: F401  (defines the ops)

    rows = op_table(ARCHITECTURE.read_text())
    listed = {re.search(r"`(quasar::\w+)`", row[0]).group(1) for row in rows}
    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("quasar::")}
    registered = {name for name in registered if not name.startswith("quasar::native_")}  # the library's own names
    assert listed == registered
    cpp = {re.search(r"`(quasar::\w+)`", row[0]).group(1): re.match(r"`(\w+)`", row[1]) for row in rows}
    source = (ROOT / "quasar_hf/ops/csrc/native_ops.cpp").read_text()
    declared = dict(re.findall(r'\{"(\w+)", \[\]\(torch::Library &l, const char \*op\) \{ l\.impl\(op, &(\w+)\); \}\}', source))
    assert len(declared) == 8  # the implementations() table
    assert {op: m.group(1) for op, m in cpp.items() if m} == {f"quasar::{op}": fn for op, fn in declared.items()}


def test_every_reference_the_op_table_names_is_a_function():
    from quasar_hf.ops import hadamard, reference

    modules = {"reference": reference, "hadamard": hadamard}
    for row in op_table(ARCHITECTURE.read_text()):
        module, name = re.search(r"`(\w+)\.(\w+)`", row[4]).groups()
        assert callable(getattr(modules[module], name, None)), row[4]


# ---------------------------------------------------------------- README figures
README = ROOT / "README.md"
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?![\w.])")


def checked_tables(text: str) -> list[tuple[list[str], list[str]]]:
    """(report paths, table lines) for every README table introduced by a line 'Report: `...json`'
    (or 'Reports:'); the table is the first one after that line."""
    found = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not re.match(r"^Reports?: ", line):
            continue
        reports = re.findall(r"`(benchmarks/[\w./-]+\.json)`", line)
        start = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("|"))
        end = next((j for j in range(start, len(lines)) if not lines[j].startswith("|")), len(lines))
        found.append((reports, lines[start + 2 : end]))  # without the header and its rule
    return found


def as_printed(value: float) -> list[float]:
    """A number as a table may print it: itself, or a ratio as a change in percent (1.0040 -> +0.40 %)."""
    return [value, (value - 1) * 100]


def records(obj) -> list[list[float]]:
    """The numbers of every JSON object in a report, one list per object: its own number values and
    short number lists ([low, high] intervals, [equal, compared] counts); long lists are raw samples,
    not figures, and nested objects are records of their own."""
    found = []
    if isinstance(obj, dict):
        numbers = []
        for value in obj.values():
            items = value if isinstance(value, list) and len(value) <= 4 else [value]
            numbers += [n for v in items if isinstance(v, (int, float)) and not isinstance(v, bool) for n in as_printed(float(v))]
        found.append(numbers)
        obj = list(obj.values())
    if isinstance(obj, list):
        found += [r for value in obj for r in records(value)]
    return found


def row_figures(row: str) -> list[str]:
    """The figures of a table row, its first cell (the row's name) left out."""
    cells = [cell.strip() for cell in row.strip().strip("|").split("|")][1:]
    return [figure for cell in cells for figure in NUMBER.findall(cell.replace("%", "").replace("*", ""))]


def matches(figure: str, numbers: list[float]) -> bool:
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    return any(f"{n:.{decimals}f}" == f"{float(figure):.{decimals}f}" for n in numbers)


def unmatched_figures(table: list[str], reports: list[list[float]]) -> list[str]:
    """Figures of each row that no single record of the reports gives all of, rounded as printed: the
    figures of the record that matches the row best are returned."""
    unmatched = []
    for row in table:
        figures = row_figures(row)
        if not figures:
            continue
        misses = min(([f for f in figures if not matches(f, numbers)] for numbers in reports), key=len, default=figures)
        unmatched += misses
    return unmatched


def numbers_of(reports: list[str]) -> list[list[float]]:
    found = []
    for report in reports:
        found += records(json.loads((ROOT / report).read_text()))
    return found


def test_every_readme_figure_is_in_the_report_its_table_names():
    tables = checked_tables(README.read_text())
    assert len(tables) >= 2, "the comparison and fidelity tables each name their report ('Report: `benchmarks/...json`')"
    for reports, table in tables:
        assert reports and table
        assert unmatched_figures(table, numbers_of(reports)) == [], reports


def test_an_edited_readme_figure_is_caught():
    """The negative control: change the first figure of each table by one unit in its last printed
    digit, and the check fails."""
    tables = checked_tables(README.read_text())
    assert tables
    for reports, table in tables:
        first = next(i for i, row in enumerate(table) if NUMBER.search("|".join(row.split("|")[2:])))
        name, rest = table[first].split("|", 2)[1], "|".join(table[first].split("|")[2:])
        figure = NUMBER.search(rest).group(0)
        decimals = len(figure.split(".")[1]) if "." in figure else 0
        edited = f"{float(figure) + 10**-decimals:.{decimals}f}"
        table = [*table[:first], f"|{name}|" + rest.replace(figure, edited, 1), *table[first + 1 :]]
        assert edited in unmatched_figures(table, numbers_of(reports)), (reports, figure, edited)


@pytest.mark.parametrize("cell, ok", [("57.2", True), ("57.3", False), ("9 of 9", True), ("+0.40 %", True), ("+0.41 %", False)])
def test_figures_are_matched_rounded_as_printed(cell, ok):
    report = records({"tokens_per_s": 57.2149, "runs": [9, 9], "ratio": 1.003987, "samples": [57.3, 1.0041, 0, 0, 0]})
    assert (unmatched_figures([f"| row | {cell} |"], report) == []) == ok


def test_a_row_must_come_from_one_record():
    report = records([{"name": "a", "tokens_per_s": 57.2}, {"name": "b", "tokens_per_s": 30.0, "exact": [9, 9]}])
    assert unmatched_figures(["| a | 57.2 | 9/9 |"], report) != []
    assert unmatched_figures(["| b | 30.0 | 9/9 |"], report) == []


# ---------------------------------------------------------------- the benchmarks index
def test_the_index_of_reports_is_the_one_the_report_files_make():
    """benchmarks/reports/README.md is generated (`python -m benchmarks.index`), never kept by hand."""
    from benchmarks.index import INDEX, index_text

    assert INDEX.read_text() == index_text(), "run `python -m benchmarks.index` and commit benchmarks/reports/README.md"


def test_every_report_lives_in_the_folder_of_a_measurement():
    from benchmarks import REPORTS
    from benchmarks.__main__ import MEASUREMENTS

    loose = [
        p.name
        for p in (ROOT / "benchmarks").iterdir()
        if p.suffix in (".json", ".png") or p.suffix == ".md" and p.name != "README.md"
    ]
    assert loose == [], "reports belong in benchmarks/reports/<measurement>/"
    folders = {p.name for p in REPORTS.iterdir() if p.is_dir()}
    assert folders <= {*MEASUREMENTS, "bench"}, folders - {*MEASUREMENTS, "bench"}  # bench: `quasar-hf bench`


def heading_slugs(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings (lower case, punctuation dropped, spaces -> '-')."""
    headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("document", ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))])
def test_every_link_between_documents_lands_on_a_file_and_heading(document):
    source = ROOT / document
    for target, anchor in re.findall(r"\]\(([\w./-]+\.md)(?:#([\w-]+))?\)", source.read_text()):
        path = (source.parent / target).resolve()
        assert path.is_file(), f"{document} links to {target}, which does not exist"
        if anchor:
            assert anchor in heading_slugs(path), f"{document} links to {target}#{anchor}: no such heading"


# ---------------------------------------------------------------- code names in prose
PACKAGE = ROOT / "quasar_hf"
CODE_NAME = re.compile(r"(?<![\w.])([a-z_][a-z0-9_]*)\.(_?[A-Za-z][A-Za-z0-9_]*)")
# Module names also used as variable names in prose (`config.max_length`): not checked.
AMBIGUOUS = {
    "config", "model", "models", "path", "loop", "report", "stats", "verify", "head", "data", "timing", "summary",
    "suites", "variants", "runner", "peers", "card", "tasks", "sandbox", "loading", "generation", "demo", "parser",
    "handlers", "cli", "prepare", "quantizer", "detect", "binding", "checks", "defaults", "attention", "drafters",
    "strategy", "batcher", "push", "accuracy", "calibration", "smoothing", "placement", "mappings", "layer_search",
    "fidelity", "per_layer", "humaneval", "serve",
}  # fmt: skip
FILE_SUFFIXES = {"py", "c", "h", "cpp", "md", "json", "def", "sh", "txt", "safetensors", "bin", "so", "jsonl", "gguf", "toml"}


def package_modules() -> dict[str, list[str]]:
    """Module file stem -> the dotted names of quasar_hf's modules with that stem."""
    found: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py" and "optimum_namespace" not in path.parts:
            found.setdefault(path.stem, []).append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    found["compat"] = ["quasar_hf.compat"]  # a package whose __init__ re-exports its functions: `compat.step_context`
    return found


def prose(path: Path) -> str:
    """What a reader takes for documentation in `path`: a Markdown file whole, a Python file's comments and
    docstrings, a C/C++ file's comments."""
    import ast
    import io
    import tokenize

    text = path.read_text()
    if path.suffix == ".md":
        return text
    if path.suffix == ".py":
        comments = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.COMMENT]
        nodes = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))]
        return "\n".join(comments + [ast.get_docstring(n) or "" for n in nodes])
    return "\n".join(re.findall(r"//[^\n]*|/\*.*?\*/", text, re.S))


def missing_code_names(text: str, modules: dict[str, list[str]]) -> list[str]:
    """`module.name` references in `text` (a quasar_hf module, or the package itself) whose name does not exist."""
    import importlib

    missing = []
    for module, name in sorted(set(CODE_NAME.findall(text))):
        if name in FILE_SUFFIXES or (module not in modules and module != "quasar_hf") or module in AMBIGUOUS:
            continue
        candidates = ["quasar_hf"] if module == "quasar_hf" else modules[module]
        owners = [importlib.import_module(full) for full in candidates]
        exists = any(hasattr(owner, name) for owner in owners) or (
            module == "quasar_hf" and importlib.util.find_spec(f"quasar_hf.{name}") is not None
        )
        if not exists:
            missing.append(f"{module}.{name}")
    return missing


def documented_files() -> list[Path]:
    files = [ARCHITECTURE, *sorted(PACKAGE.rglob("*.py"))]
    return files + sorted(p for p in (PACKAGE / "ops" / "csrc").iterdir() if p.suffix in (".c", ".cpp", ".h"))


@pytest.mark.parametrize("path", documented_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_code_name_in_architecture_comments_and_docstrings_exists(path):
    pytest.importorskip("triton", reason="the Triton modules import triton")
    assert missing_code_names(prose(path), package_modules()) == []


def test_a_code_name_that_no_longer_exists_is_caught():
    modules = package_modules()
    text = "cpu_fused._MIN_BYTES_PER_THREAD, backends._from_fold, reference.w8a8_linear_reference, config.json, quasar_hf.nope"
    text += ", compat.step_context, compat.no_such_shim"
    assert missing_code_names(text, modules) == [
        "backends._from_fold",
        "compat.no_such_shim",
        "cpu_fused._MIN_BYTES_PER_THREAD",
        "quasar_hf.nope",
    ]
