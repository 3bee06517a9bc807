"""Faults found by trying the package as a new user would: each gets a clear error (or just works)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, StaticCache

import quasar_hf  # noqa: F401 - registers quant_method "quasar"
from quasar_hf import QuasarConfig
from quasar_hf.cli import main
from quasar_hf.commands.doctor import doctor_report
from quasar_hf.ops import c_build, native
from tests.helpers.hub import make_tiny_checkpoint

FAST = dict(num_calibration_samples=2, calibration_seq_len=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "base")


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "tiny-quasar"
    model = AutoModelForCausalLM.from_pretrained(tiny, quantization_config=QuasarConfig(**FAST), dtype=torch.float32)
    model.save_pretrained(out)
    return out


def edited_copy(saved: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "edited"
    folder.mkdir()
    for item in saved.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "field, value", [("alpha_grid", "abc"), ("alpha_grid", 5), ("alpha_grid", [0.5, "x"]), ("draft_info", "x"), ("measured", 3)]
)
def test_config_fields_of_the_wrong_type_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        QuasarConfig(**{field: value})


def test_a_checkpoint_of_another_format_version_is_refused(saved, tmp_path):
    folder = edited_copy(saved, tmp_path, lambda q: q.update(version="99"))
    with pytest.raises(ValueError, match="format version"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_int8_weights_missing_from_quantized_modules_are_refused_at_load(saved, tmp_path):
    def drop_one(qconfig):
        qconfig["quantized_modules"] = [n for n in qconfig["quantized_modules"] if n != "model.layers.0.mlp.down_proj"]

    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj"):
        AutoModelForCausalLM.from_pretrained(edited_copy(saved, tmp_path, drop_one))


def test_a_static_cache_with_quasar_is_refused_not_ignored(saved):
    model = AutoModelForCausalLM.from_pretrained(saved)
    cache = StaticCache(config=model.config, max_cache_len=64)
    with pytest.raises(ValueError, match="StaticCache"):
        model.generate(torch.tensor([[5, 6, 7, 5, 6, 7]]), max_new_tokens=4, quasar=True, past_key_values=cache)


def test_quantizing_a_quasar_checkpoint_again_is_a_one_line_usage_error(saved, tmp_path, capsys):
    assert main(["quantize", str(saved), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already a Quasar W8A8 checkpoint" in err[0], err
    assert not (tmp_path / "again").exists()


def test_bench_with_a_missing_model_folder_says_so(tmp_path, capsys):
    assert main(["bench", "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_doctor_lists_the_lm_head_kernel():
    report = doctor_report()
    assert "Float lm_head" in report and "rowstable_cpu" in report.split("Float lm_head", 1)[1]


def test_out_on_a_bind_mount_of_the_input_is_refused(tiny, tmp_path, capsys):
    mount_point = tmp_path / "mounted"
    mount_point.mkdir()
    if subprocess.run(["mount", "--bind", str(tiny), str(mount_point)], capture_output=True).returncode != 0:
        pytest.skip("bind mounts need root and a mount namespace that allows them")
    try:
        code = main(["quantize", str(tiny), "--out", str(mount_point), "--overwrite"])
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)
    assert code == 2 and "is the input folder" in capsys.readouterr().err


KERNELS = (
    "from quasar_hf.ops import cpu_fused, rowstable_linear\n"
    "print('fused', cpu_fused.unavailable_reason()); print('lm_head', rowstable_linear.unavailable_reason())\n"
)


def run_kernels(cache: Path, with_compiler: bool) -> str:
    env = {**os.environ, "QUASAR_HF_KERNEL_CACHE": str(cache)}
    env.pop("CXX", None)
    if not with_compiler:
        env["PATH"] = str(cache / "no-compilers-here")
    done = subprocess.run([sys.executable, "-c", KERNELS], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(bool(__import__("quasar_hf.ops.c_build", fromlist=["x"]).missing_cpu_flags(("avx2",))), reason="needs AVX2")
def test_kernels_built_earlier_load_without_a_compiler(tmp_path):
    cache = tmp_path / "kernels"
    for library in c_build.cache_dir().glob(f"*/lib{native.LIBRARY}.so"):  # this process's builds: no minute-long rebuild
        shutil.copytree(library.parent, cache / library.parent.name, ignore=shutil.ignore_patterns(".lock"))
    assert run_kernels(cache, with_compiler=True) == "fused None\nlm_head None\n"
    assert run_kernels(cache, with_compiler=False) == "fused None\nlm_head None\n", "the built kernels must be used"
    empty = run_kernels(tmp_path / "empty", with_compiler=False)
    assert empty.count("no C++ compiler found") == 2, empty
