"""`python -m benchmarks`: every measurement it lists resolves to a callable, and bad names get a clear error."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import MEASUREMENTS, main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(MEASUREMENTS))
def test_every_measurement_resolves_to_a_main(name):
    module_name, function = MEASUREMENTS[name][0].split(":")
    assert callable(getattr(importlib.import_module(module_name), function))


def test_listing_names_every_measurement(capsys):
    assert main([]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in MEASUREMENTS)


def test_unknown_measurement_is_a_usage_error(capsys):
    assert main(["alpha-sweep"]) == 2
    error = capsys.readouterr().err
    assert "unknown measurement 'alpha-sweep'" in error and "step" in error


def test_runs_as_a_module_and_forwards_options():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "kernels", "--help"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--shapes" in done.stdout and "python -m benchmarks kernels" in done.stdout
