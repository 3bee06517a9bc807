"""Print the import graph between quasar_hf's subpackages and fail on an upward edge.

Layers, lowest first: a module may import its own layer and the layers below it, never above.
Every import counts, including imports inside functions (they are dependencies all the same).

    python -m scripts.import_graph            # the edges, the layer picture; exit 1 on an upward edge
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = "quasar_hf"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
# Lowest first; units in one layer may import each other. "__init__" is the package's public
# facade (`from quasar_hf import QuasarConfig`), at the application layer with the CLI and the bench.
LAYERS: list[tuple[str, ...]] = [
    ("compat", "locking", "atomic_folder"),
    ("ops",),
    ("nn",),
    ("smoothquant", "speculative"),
    ("hf",),
    ("models", "export"),
    ("bench", "eval", "commands", "cli", "__init__"),
]
LAYER_OF = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str:
    """'quasar_hf.speculative.loop' -> 'speculative'; 'quasar_hf' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path) -> set[str]:
    """quasar_hf modules imported by the file at `path` (absolute and relative imports)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            if target == PACKAGE:  # `from quasar_hf import compat` names a unit; `import QuasarConfig` the facade
                for alias in node.names:
                    is_unit = (ROOT / alias.name).is_dir() or (ROOT / f"{alias.name}.py").is_file()
                    found.add(f"{PACKAGE}.{alias.name}" if is_unit else PACKAGE)
            else:
                found.add(target)
    return found


def edges() -> dict[tuple[str, str], list[str]]:
    """(from unit, to unit) -> the files that make the edge (same-unit imports left out)."""
    graph: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(ROOT.rglob("*.py")):
        if "optimum_namespace" in path.parts:
            continue
        source = unit_of(module_name(path))
        for target in imported_modules(path):
            unit = unit_of(target)
            if unit != source and unit in LAYER_OF:
                graph[(source, unit)].append(str(path.relative_to(ROOT.parent)))
    return dict(graph)


def upward_edges(graph: dict[tuple[str, str], list[str]]) -> list[str]:
    """Edges from a unit to a unit in a higher layer, with the files that make them."""
    return [
        f"{a} -> {b} (layer {LAYER_OF[a]} -> {LAYER_OF[b]}): {', '.join(sorted(set(files)))}"
        for (a, b), files in sorted(graph.items())
        if LAYER_OF.get(a, len(LAYERS)) < LAYER_OF[b]
    ]


def render(graph: dict[tuple[str, str], list[str]]) -> str:
    lines = ["layers (top imports down):"]
    for level in reversed(range(len(LAYERS))):
        units = LAYERS[level]
        lines.append(f"  {level}  " + "  ".join(units))
    lines.append("edges:")
    for unit in [u for layer in reversed(LAYERS) for u in layer]:
        targets = sorted({b for (a, b) in graph if a == unit}, key=lambda u: (-LAYER_OF[u], u))
        if targets:
            lines.append(f"  {unit:<12} -> {', '.join(targets)}")
    return "\n".join(lines)


def main() -> int:
    graph = edges()
    print(render(graph))
    unknown = sorted({unit_of(module_name(p)) for p in ROOT.rglob("*.py")} - set(LAYER_OF) - {"data"})
    bad = upward_edges(graph)
    for unit in unknown:
        bad.append(f"{unit}: not placed in any layer (add it to LAYERS in scripts/import_graph.py)")
    if bad:
        print("upward edges:\n  " + "\n  ".join(bad))
        return 1
    print("no upward edges")
    return 0


if __name__ == "__main__":
    sys.exit(main())
