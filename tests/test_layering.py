"""Layering rules: other packages' private names only in quasar_hf/compat/; no upward imports between subpackages;
no import cycle between modules anywhere in the package.

The private-name scan reads every module's AST. For Transformers it flags
  * imports of underscore names from transformers (`from transformers.x import _y`, `transformers._x`),
  * imports of KV-cache layer classes from `transformers.cache_utils` (their set changes between releases),
  * imports of `transformers.cli` (the CLI's internals: `transformers serve`'s handlers and app),
  * attribute access to a single-underscore name (`model.config._attn_implementation`,
    `AttentionInterface._global_mapping`) unless it is on `self`/`cls` or on a module imported from a
    package other than transformers (`torch._int_mm`), and `getattr`/`hasattr`/`setattr` with such a name;
for torch, Dynamo's and Inductor's private modules (`torch._dynamo.config`, `from torch._dynamo.utils import
counters`, `torch._inductor`); for Accelerate, its hook internals (`accelerate.hooks`, the `_hf_hook` and
`_old_forward` attributes it sets on a module, on any object, through getattr/hasattr/setattr too) and
underscore names from accelerate. A module outside compat/ may reach exactly what INTERNALS_ALLOWED names.
Negative controls feed it snippets that reach each vendor's private API and check each is flagged.
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
# Exactly the internals a module outside compat/ may reach (what the scan reports, less file and line).
INTERNALS_ALLOWED = {
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
                    parts = alias.name.split(".")
                    if any(_is_private(part) for part in parts) or parts[:2] == ["transformers", "cli"]:
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
            if parts[:2] == ["transformers", "cli"]:
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
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


TORCH_PRIVATE_MODULES = {"_dynamo", "_inductor"}  # torch.compile's internals: settings, counters, caches
ACCELERATE_HOOK_ATTRIBUTES = {"_hf_hook", "_old_forward"}  # where accelerate keeps a module's hook and its own forward


def private_torch_uses(source: str, filename: str = "<snippet>") -> list[str]:
    """Every place in `source` that reaches torch._dynamo or torch._inductor."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.split(".")[0] == "torch"]
            found += [f"{filename}:{node.lineno}: import {n}" for n in names if TORCH_PRIVATE_MODULES & set(n.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch" and not node.level:
            imported = set(node.module.split(".")) | {alias.name for alias in node.names}
            if TORCH_PRIVATE_MODULES & imported:
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr in TORCH_PRIVATE_MODULES:
            found.append(f"{filename}:{node.lineno}: .{node.attr}")
    return found


def private_accelerate_uses(source: str, filename: str = "<snippet>") -> list[str]:
    """Every place in `source` that reaches accelerate's hook internals or an underscore name of accelerate."""
    tree = ast.parse(source, filename)
    accelerate_names = {
        a.asname or "accelerate"
        for n in ast.walk(tree)
        if isinstance(n, ast.Import)
        for a in n.names
        if a.name.split(".")[0] == "accelerate"
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "accelerate" and (parts[:2] == ["accelerate", "hooks"] or any(map(_is_private, parts))):
                    found.append(f"{filename}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "accelerate" and not node.level:
            parts = node.module.split(".")
            names = [alias.name for alias in node.names]
            if parts[:2] == ["accelerate", "hooks"] or any(map(_is_private, parts + names)) or "hooks" in names:
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr in ACCELERATE_HOOK_ATTRIBUTES:
            found.append(f"{filename}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in accelerate_names:
            if node.attr == "hooks" or _is_private(node.attr):  # `accelerate.hooks.add_hook_to_module`
                found.append(f"{filename}:{node.lineno}: accelerate.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr"):
            if (
                len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in ACCELERATE_HOOK_ATTRIBUTES
            ):
                found.append(f"{filename}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def private_uses(source: str, filename: str = "<snippet>") -> list[str]:
    """Every place in `source` that reaches a private name of Transformers, torch.compile or accelerate."""
    scans = (private_transformers_uses, private_torch_uses, private_accelerate_uses)
    return sorted({use for scan in scans for use in scan(source, filename)})


def uses_outside_compat() -> dict[str, list[str]]:
    """Module path -> the private names it reaches, for every module outside quasar_hf/compat/ that reaches one."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if ALLOWED_DIR not in path.parents:
            name = str(path.relative_to(REPO))
            uses = private_uses(path.read_text(encoding="utf-8"), name)
            if uses:
                found[name] = uses
    return found


def test_only_compat_reaches_private_names():
    found = [
        use
        for name, uses in uses_outside_compat().items()
        for use in uses
        if use.split(": ", 1)[1] not in INTERNALS_ALLOWED.get(name, set())
    ]
    assert not found, "private names of other packages outside quasar_hf/compat/:\n" + "\n".join(found)


def test_every_allowed_internal_is_still_reached():
    """INTERNALS_ALLOWED lists exactly what is needed: an entry nothing reaches any more is removed."""
    found = uses_outside_compat()
    for name, allowed in INTERNALS_ALLOWED.items():
        assert allowed <= {use.split(": ", 1)[1] for use in found.get(name, [])}, name


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
        "from transformers.cli.serving.utils import DirectStreamer",
        "import transformers.cli.serving.server",
    ],
)
def test_negative_control_the_scanner_flags_private_uses(snippet):
    assert private_transformers_uses(snippet) and private_uses(snippet)


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch._dynamo.config.recompile_limit = 16",
        "import torch\n\ndef f():\n    return torch._dynamo.utils.counters['stats']['unique_graphs']",
        "import torch._dynamo",
        "from torch._dynamo.package import DynamoCache",
        "from torch import _dynamo",
        "import torch\ntorch._inductor.config.fx_graph_cache = True",
        "from torch._inductor import config",
    ],
)
def test_negative_control_the_scanner_flags_private_torch_compile_uses(snippet):
    assert private_torch_uses(snippet) and private_uses(snippet)
    assert not private_transformers_uses(snippet)  # torch is another package: only the torch scan sees these


@pytest.mark.parametrize(
    "snippet",
    [
        "def f(module):\n    return hasattr(module, '_hf_hook')",
        "def f(module):\n    return module._hf_hook.execution_device",
        "from accelerate.hooks import add_hook_to_module",
        "import accelerate.hooks",
        "from accelerate import hooks",
        "from accelerate.utils.modeling import _get_named_modules",
        "import accelerate\n\ndef f(module):\n    return accelerate.hooks.remove_hook_from_module(module)",
        "class A:\n    def f(self):\n        return self._old_forward",
    ],
)
def test_negative_control_the_scanner_flags_accelerate_hook_uses(snippet):
    assert private_accelerate_uses(snippet) and private_uses(snippet)


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch._int_mm",
        "class A:\n    def f(self):\n        return self._state",
        "from transformers import DynamicCache\nDynamicCache(config=None)",
        "def f(t):\n    return t._version",
        "import torch\ntorch.compiler.is_compiling()",
        "import torch\ntorch.compile(lambda x: x, fullgraph=True)",
        "from accelerate import init_empty_weights",
        "from transformers import GenerationConfig",
    ],
)
def test_public_uses_are_not_flagged(snippet):
    assert not private_uses(snippet)


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
