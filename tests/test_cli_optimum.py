"""`optimum-cli quasar ...` through Optimum's documented `optimum.commands.register` namespace.

The registration module ships in our tree under quasar_hf/commands/optimum_namespace/ and is
installed as optimum/commands/register/quasar_hf.py; here that namespace portion is put on
PYTHONPATH (what an installed wheel provides through site-packages) unless an install already
provides it, and this checkout's quasar_hf comes first on PYTHONPATH either way."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import quasar_hf.commands

NAMESPACE_ROOT = Path(quasar_hf.commands.__file__).parent / "optimum_namespace"
REPO_ROOT = Path(quasar_hf.commands.__file__).parents[2]
OPTIMUM_CLI = Path(sys.executable).parent / "optimum-cli"


def optimum_cli(*argv: str) -> subprocess.CompletedProcess:
    # An (editable) install of quasar-hf already registers the command: adding our namespace too
    # would register `quasar` twice. Its module imports quasar_hf, found first in REPO_ROOT.
    installed = importlib.util.find_spec("optimum.commands.register.quasar_hf") is not None
    paths = [str(REPO_ROOT)] + ([] if installed else [str(NAMESPACE_ROOT)])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([str(OPTIMUM_CLI), *argv], capture_output=True, text=True, env=env, timeout=300)


def test_registration_module_exists_in_the_namespace_layout():
    module = NAMESPACE_ROOT / "optimum" / "commands" / "register" / "quasar_hf.py"
    assert "REGISTER_COMMANDS" in module.read_text()
    assert not (NAMESPACE_ROOT / "optimum" / "__init__.py").exists()  # PEP 420: no __init__ anywhere on the way
    assert not (NAMESPACE_ROOT / "optimum" / "commands" / "register" / "__init__.py").exists()


def test_optimum_cli_helps_quasar():  # each optimum-cli start imports torch: keep the calls few
    result = optimum_cli("quasar", "--help")
    assert result.returncode == 0, result.stderr
    for name in ("quantize", "generate", "export", "bench", "eval", "demo"):
        assert name in result.stdout


def test_optimum_cli_quasar_user_error_is_one_line_exit_2(tmp_path):
    result = optimum_cli("quasar", "export", str(tmp_path / "missing/model"), "--out", str(tmp_path / "never-written"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        line for line in result.stderr.strip().splitlines() if line.startswith("optimum-cli quasar export: error:")
    ]
    assert "does not exist" in result.stderr
