"""Layering rules: private Transformers names only in quasar_hf/compat/; no upward imports between subpackages;
no import cycle between modules anywhere in the package.

The private-name scan reads every module's AST and flags
  * imports of underscore names from transformers (`from transformers.x import _y`, `transformers._x`),
  * imports of KV-cache layer classes from `transformers.cache_utils` (their set changes between releases),
  * attribute access to a single-underscore name (`model.config._attn_implementation`,
    `AttentionInterface._global_mapping`) unless it is on `self`/`cls` or on a module imported from a
    package other than transformers (`torch._int_mm`), and `getattr`/`hasattr`/`setattr` with such a name.
Negative controls feed it snippets that reach private Transformers API and check each is flagged.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "quasar_hf"
ALLOWED_DIR = PACKAGE / "compat"
# torch's own private names a module may use (tensor version counters): not Transformers API.
TORCH_PRIVATE_OK = {"_version", "_apply"}  # torch.nn.Module._apply: behind .to(), bound by hf/binding.py
CACHE_LAYER_SUFFIXES = ("Layer",)
# Exactly the Transformers internals a module outside compat/ may reach (what the scan reports, less file and line).
TRANSFORMERS_INTERNALS_ALLOWED = {
    # AppendInPlaceLayer subclasses it: a KV-cache feature, installed through compat.append_kv_in_place
    "quasar_hf/speculative/append_in_place.py": {"cache layer class DynamicLayer"},
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    if isinstance(node, ast.Call):
        return _root_name(node.func)
    return node.id if isinstance(node, ast.Name) else None


def private_transformers_uses(source: str, filename: str = "<snippet>") -> list[str]:
    """Every place in `source` that reaches a private Transformers name (see the module docstring)."""
    tree = ast.parse(source, filename)
    other_modules = set()  # names bound to modules/objects of packages other than transformers
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top == "transformers":
                    if any(_is_private(part) for part in alias.name.split(".")):
                        found.append(f"{filename}:{node.lineno}: import {alias.name}")
                else:
                    other_modules.add(alias.asname or top)
        elif isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] != "transformers" or node.level:
                other_modules.update(alias.asname or alias.name for alias in node.names)
                continue
            if any(_is_private(part) for part in parts):
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {alias.name}")
                elif node.module == "transformers.cache_utils" and alias.name.endswith(CACHE_LAYER_SUFFIXES):
                    found.append(f"{filename}:{node.lineno}: cache layer class {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in TORCH_PRIVATE_OK:
            root = _root_name(node.value)
            if root in ("self", "cls", "super") or root in other_modules:
                continue
            found.append(f"{filename}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr"):
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                name = node.args[1].value
                root = _root_name(node.args[0])
                if _is_private(name) and root not in ("self", "cls") and root not in other_modules:
                    found.append(f"{filename}:{node.lineno}: {node.func.id}(..., {name!r})")
    return found


def test_only_compat_reaches_private_transformers_names():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ALLOWED_DIR not in path.parents:
            name = str(path.relative_to(REPO))
            allowed = TRANSFORMERS_INTERNALS_ALLOWED.get(name, set())
            uses = private_transformers_uses(path.read_text(encoding="utf-8"), name)
            found += [use for use in uses if use.split(": ", 1)[1] not in allowed]
    assert not found, "private Transformers names outside quasar_hf/compat/:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "from transformers import AttentionInterface\nAttentionInterface._global_mapping",
        "def f(model):\n    return model.config._attn_implementation",
        "def f(model, config):\n    return model._prepare_generation_config(config)",
        "from transformers.cache_utils import DynamicLayer",
        "from transformers.generation.utils import _split_model_inputs",
        "import transformers._private_module",
        "def f(config):\n    return getattr(config, '_name_or_path', None)",
        "def f(module):\n    module._modules = {}",
    ],
)
def test_negative_control_the_scanner_flags_private_uses(snippet):
    assert private_transformers_uses(snippet)


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch._int_mm",
        "class A:\n    def f(self):\n        return self._state",
        "from transformers import DynamicCache\nDynamicCache(config=None)",
        "def f(t):\n    return t._version",
    ],
)
def test_public_uses_are_not_flagged(snippet):
    assert not private_transformers_uses(snippet)


def test_import_graph_has_no_upward_edge_and_no_cycle():
    result = subprocess.run([sys.executable, "-m", "scripts.import_graph"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no upward edges, no import cycles" in result.stdout


def test_negative_control_an_upward_edge_is_reported():
    from scripts.import_graph import upward_edges

    assert upward_edges({("speculative", "hf"): ["quasar_hf/speculative/x.py"]})
    assert not upward_edges({("hf", "speculative"): ["quasar_hf/hf/x.py"]})


def test_negative_control_cycles_are_found_within_and_across_subpackages():
    from scripts.import_graph import import_cycles

    graph = {
        "quasar_hf.bench.runner": {"quasar_hf.bench.report"},
        "quasar_hf.bench.report": {"quasar_hf.bench.peers", "quasar_hf.ops"},
        "quasar_hf.bench.peers": {"quasar_hf.bench.runner"},  # runner -> report -> peers -> runner
        "quasar_hf.ops": {"quasar_hf.compat"},
        "quasar_hf.compat": set(),
        "quasar_hf.nn.a": {"quasar_hf.ops.b"},
        "quasar_hf.ops.b": {"quasar_hf.nn.a"},  # a two-module cycle across subpackages
    }
    assert import_cycles(graph) == [
        ["quasar_hf.bench.peers", "quasar_hf.bench.report", "quasar_hf.bench.runner"],
        ["quasar_hf.nn.a", "quasar_hf.ops.b"],
    ]
    assert import_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []  # a diamond is no cycle


def test_the_module_graph_resolves_from_imports_of_submodules():
    from scripts.import_graph import module_graph

    graph = module_graph()
    assert "quasar_hf.ops.dispatch" in graph["quasar_hf.ops.torch_ops"]  # `from quasar_hf.ops import dispatch`
    assert "quasar_hf.ops" not in graph["quasar_hf.ops.torch_ops"]
    assert "quasar_hf.hf" in graph["quasar_hf"]  # the facade imports the subpackage
