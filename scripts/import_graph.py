"""Print the import graph between quasar_hf's subpackages; fail on an upward edge or an import cycle.

Layers, lowest first: a module may import its own layer and the layers below it, never above.
Within and across subpackages, no file may import itself through other files (a cycle of modules).
Every import counts, including imports inside functions (they are dependencies all the same).
`from package import name` is an edge to the submodule `package.name` when that is a module, else
to the package's `__init__`.

    python -m scripts.import_graph            # the edges, the layer picture; exit 1 on either fault
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
    ("compat", "locking", "atomic_folder", "detect", "architectures"),
    ("ops",),
    ("nn",),
    ("smoothquant", "speculative", "hub"),
    ("self_draft",),
    ("hf",),
    ("models", "export"),
    ("bench", "eval", "serving", "commands", "cli", "__init__"),
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


def is_module(name: str) -> bool:
    """Whether dotted `name` ('quasar_hf.ops.dispatch') is a module or package file of quasar_hf."""
    relative = Path(*name.split(".")[1:]) if "." in name else Path()
    return (ROOT / relative / "__init__.py").is_file() or (ROOT / relative).with_suffix(".py").is_file()


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
            for alias in node.names:  # `from quasar_hf.ops import dispatch` names a module; `import w8a8_linear` the package
                found.add(f"{target}.{alias.name}" if is_module(f"{target}.{alias.name}") else target)
    return found


def module_graph() -> dict[str, set[str]]:
    """Module -> the quasar_hf modules it imports (itself left out)."""
    graph = {}
    for path in sorted(ROOT.rglob("*.py")):
        if "optimum_namespace" not in path.parts:
            graph[module_name(path)] = set()
    for path in sorted(ROOT.rglob("*.py")):
        if "optimum_namespace" in path.parts:
            continue
        this = module_name(path)
        for target in imported_modules(path):
            while target not in graph and "." in target:  # `import quasar_hf.ops.dispatch.x` -> the file it names
                target = target.rsplit(".", 1)[0]
            if target in graph and target != this:
                graph[this].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of two or more modules that import each other through a cycle (Tarjan's strongly
    connected components, iterative), each sorted, the list sorted."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = lowlink[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            advanced = False
            for target in targets:
                if target not in index:
                    index[target] = lowlink[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    advanced = True
                    break
                if target in on_stack:
                    lowlink[node] = min(lowlink[node], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                lowlink[work[-1][0]] = min(lowlink[work[-1][0]], lowlink[node])
            if lowlink[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)


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
    cycles = import_cycles(module_graph())
    if bad:
        print("upward edges:\n  " + "\n  ".join(bad))
    if cycles:
        print("import cycles (modules that import each other):\n  " + "\n  ".join(" <-> ".join(c) for c in cycles))
    if bad or cycles:
        return 1
    print("no upward edges, no import cycles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
