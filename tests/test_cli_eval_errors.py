"""`quasar-hf eval --tasks ...` reports user errors in one line with exit code 2, before loading any model."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import quasar_hf.eval.tasks as eval_tasks
from quasar_hf import QuasarConfig
from quasar_hf.cli import main
from tests.helpers.hub import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "base")


@pytest.fixture(scope="module")
def quasar_checkpoint(tiny, tmp_path_factory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("q") / "tiny-quasar"
    config = QuasarConfig(num_calibration_samples=2, calibration_seq_len=32)
    AutoModelForCausalLM.from_pretrained(tiny, quantization_config=config, dtype=torch.float32).save_pretrained(out)
    return out


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quasar-hf eval: error: "), err
    return err[0]


def test_a_missing_checkpoint_is_one_line(capsys, tmp_path):
    assert main(["eval", str(tmp_path / "missing"), "--tasks", "quasar_tiny_mc"]) == 2
    assert "does not exist" in one_line_error(capsys)


def test_an_unknown_task_is_one_line_naming_close_tasks(capsys, tiny, monkeypatch):
    index = SimpleNamespace(all_tasks=["arc_easy", "arc_challenge", "hellaswag"])  # lm-eval's index, without its 20 s build
    monkeypatch.setattr(eval_tasks, "task_manager_for", lambda specs: index)
    assert main(["eval", str(tiny), "--tasks", "arc_esy"]) == 2
    line = one_line_error(capsys)
    assert "unknown lm-eval task arc_esy" in line and "arc_easy" in line


def test_a_missing_task_file_is_one_line(capsys, tiny, tmp_path):
    assert main(["eval", str(tiny), "--tasks", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in one_line_error(capsys)


def test_a_quasar_checkpoint_without_reference_is_one_line(capsys, quasar_checkpoint):
    assert main(["eval", str(quasar_checkpoint), "--tasks", "quasar_tiny_mc"]) == 2
    assert "--reference" in one_line_error(capsys)


def test_a_quasar_reference_is_one_line(capsys, quasar_checkpoint):
    args = ["eval", str(quasar_checkpoint), "--reference", str(quasar_checkpoint), "--tasks", "quasar_tiny_mc"]
    assert main(args) == 2
    assert "unquantized original" in one_line_error(capsys)


def test_a_runtime_failure_is_one_line_with_code_1(capsys, tiny, monkeypatch):
    import quasar_hf.eval.lm_eval_runner as runner

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory\nmore detail")

    monkeypatch.setattr(runner, "compare_tasks", broken)
    monkeypatch.setattr(
        "quasar_hf.eval.loading.load_pair", lambda *a, **k: SimpleNamespace(quantized=None, reference=None, tokenizer=None)
    )
    assert main(["eval", str(tiny), "--tasks", "quasar_tiny_mc"]) == 1
    assert one_line_error(capsys).endswith("RuntimeError: out of memory")
