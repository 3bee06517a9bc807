"""`--out` checks of `quasar-hf quantize` and `export`: never the input folder, never a file or an
unrelated non-empty folder without --overwrite, writability checked before any work; and
`--text-column` for calibration data whose text column has another name."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from quasar_hf.cli import main
from quasar_hf.commands import loading, output_dir
from quasar_hf.commands.loading import UsageError
from quasar_hf.commands.output_dir import check_output_dir
from tests.helpers.hub import make_tiny_checkpoint

QUANTIZE_FAST = ["--alpha", "0.5", "--num-samples", "1", "--seq-len", "32", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "base")


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command gets as far as loading or quantizing a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the --out check must refuse before any model is loaded")

    monkeypatch.setattr(loading, "quantize_checkpoint", refuse)
    monkeypatch.setattr(loading, "load_model", refuse)


def fingerprint(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def fake_quasar_checkpoint(tiny: Path, folder: Path) -> Path:
    """A copy of `tiny` whose config says Quasar (what `export` checks before loading)."""
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "quasar"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run_refused(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_quantize_refuses_the_input_folder_itself_and_through_a_symlink(tiny, tmp_path, no_work, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny, model)
    before = fingerprint(model)
    run_refused(["quantize", str(model), "--out", str(model), *QUANTIZE_FAST], "is the input folder", capsys)
    (tmp_path / "link").symlink_to(model)
    run_refused(["quantize", str(model), "--out", str(tmp_path / "link"), "--overwrite"], "is the input folder", capsys)
    run_refused(["quantize", str(tmp_path / "link"), "--out", str(model / "q")], "inside the input folder", capsys)
    assert fingerprint(model) == before


def test_export_refuses_the_input_folder(tiny, tmp_path, no_work, capsys):
    model = fake_quasar_checkpoint(tiny, tmp_path / "quasar")
    before = fingerprint(model)
    run_refused(["export", str(model), "--out", str(model), "--overwrite"], "is the input folder", capsys)
    run_refused(["export", str(model), "--out", str(model / "ct")], "inside the input folder", capsys)
    assert fingerprint(model) == before


def test_non_empty_unrelated_folder_needs_overwrite(tiny, tmp_path, no_work, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("my notes")
    run_refused(["quantize", str(tiny), "--out", str(busy)], "--overwrite", capsys)
    model = fake_quasar_checkpoint(tiny, tmp_path / "quasar")
    run_refused(["export", str(model), "--out", str(tiny)], "not a compressed-tensors checkpoint", capsys)
    assert (busy / "notes.txt").read_text() == "my notes"
    assert check_output_dir(str(busy), str(tiny), "quasar", overwrite=True) == busy.resolve()


def test_same_kind_checkpoint_or_empty_folder_is_accepted(tiny, tmp_path):
    previous = fake_quasar_checkpoint(tiny, tmp_path / "previous")  # an earlier quantize result: replaced
    assert check_output_dir(str(previous), str(tiny), "quasar") == previous.resolve()
    with pytest.raises(UsageError, match="not a compressed-tensors"):
        check_output_dir(str(previous), str(tiny), "compressed-tensors")
    (tmp_path / "empty").mkdir()
    check_output_dir(str(tmp_path / "empty"), str(tiny), "compressed-tensors")
    check_output_dir(str(tmp_path / "new" / "deeper"), str(tiny), "quasar")
    check_output_dir(str(tmp_path / "q"), "owner/hub-model", "quasar")  # a Hub id has no local folder


def test_file_or_unwritable_out_fails_before_quantizing(tiny, tmp_path, no_work, monkeypatch, capsys):
    a_file = tmp_path / "weights.bin"
    a_file.write_text("keep me")
    run_refused(["quantize", str(tiny), "--out", str(a_file), "--overwrite"], "is a file", capsys)
    run_refused(["quantize", str(tiny), "--out", str(a_file / "sub")], "cannot be created", capsys)
    assert a_file.read_text() == "keep me"

    def read_only(*args, **kwargs):  # what a read-only folder or file system answers (root ignores chmod)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(output_dir.tempfile, "TemporaryFile", read_only)
    run_refused(["quantize", str(tiny), "--out", str(tmp_path / "out")], "is not writable", capsys)
    run_refused(
        ["export", str(fake_quasar_checkpoint(tiny, tmp_path / "q")), "--out", str(tmp_path / "ct")], "not writable", capsys
    )


def test_export_api_refuses_the_folder_the_model_came_from(tiny, tmp_path):
    from quasar_hf.export.compressed_tensors import export_compressed_tensors
    from tests.helpers.hub import quantize_tiny

    model_dir = tmp_path / "model"
    shutil.copytree(tiny, model_dir)
    model = quantize_tiny(model_dir)
    before = fingerprint(model_dir)
    with pytest.raises(ValueError, match="loaded from"):
        export_compressed_tensors(model, model_dir)
    with pytest.raises(ValueError, match="loaded from"):
        export_compressed_tensors(model, model_dir / "sub")
    assert fingerprint(model_dir) == before


def test_quantize_text_column_for_a_csv(tiny, tmp_path, capsys):
    data = tmp_path / "calib.csv"
    rows = ['"def add(a, b): return a + b. The quick brown fox jumps over the lazy dog.",7'] * 20
    data.write_text("body,id\n" + "\n".join(rows) + "\n")
    argv = ["quantize", str(tiny), "--calibration-dataset", str(data), *QUANTIZE_FAST]
    assert main([*argv, "--out", str(tmp_path / "q1")]) == 1
    err = capsys.readouterr().err
    assert "--text-column" in err and "'body'" in err and "calibration_text_column" in err
    assert main([*argv, "--out", str(tmp_path / "q2"), "--text-column", "body"]) == 0
    info = json.loads((tmp_path / "q2" / "config.json").read_text())["quantization_config"]
    assert info["calibration_text_column"] == "body"
