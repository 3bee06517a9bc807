"""Saves replace a checkpoint folder in one step: a failed or killed save leaves the old one loadable."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401 - registers quant_method "quasar"
from quasar_hf import QuasarConfig
from quasar_hf.atomic_folder import (
    STAGING_TAG,
    CheckpointWriteError,
    atomic_folder,
    remove_dead_staging,
    safetensors_problem,
    verify_checkpoint_files,
)
from tests.helpers.tiny_models import char_tokenizer, save_tiny

IDS = torch.tensor([[5, 17, 33, 2, 71, 40, 9, 88, 12, 3]])
FAST = dict(num_calibration_samples=4, calibration_seq_len=64)
KEEP = ["model.layers.0.mlp.down_proj"]


def quantize(src, **kwargs):
    return AutoModelForCausalLM.from_pretrained(src, quantization_config=QuasarConfig(**FAST, **kwargs), dtype=torch.float32)


def logits_of(folder) -> torch.Tensor:
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder)(IDS).logits


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if STAGING_TAG in p.name)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """A (default) and B (keep_float: another config and other tensors), with their logits."""
    src = save_tiny(tmp_path_factory.mktemp("src") / "tiny")
    a, b = quantize(src), quantize(src, keep_float=KEEP)
    with torch.no_grad():
        return src, a, b, a(IDS).logits, b(IDS).logits


def test_a_failed_weight_write_keeps_the_old_checkpoint(tmp_path, two_models, monkeypatch):
    _, a, b, logits_a, _ = two_models
    folder = tmp_path / "ckpt"
    a.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    (folder / "notes.txt").write_text("mine")
    import transformers.modeling_utils as modeling_utils

    real_save = modeling_utils.safe_save_file

    def disk_full(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as handle:
            handle.write(b"\0" * 1000)  # a partial file, then the error a full disk gives
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(modeling_utils, "safe_save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        b.save_pretrained(folder)
    monkeypatch.setattr(modeling_utils, "safe_save_file", real_save)
    assert torch.equal(logits_of(folder), logits_a)
    assert (folder / "notes.txt").read_text() == "mine" and (folder / "tokenizer.json").is_file()
    assert leftovers(folder) == []


def test_an_overwrite_swaps_in_the_new_checkpoint_and_keeps_other_files(tmp_path, two_models):
    _, a, b, _, logits_b = two_models
    folder = tmp_path / "ckpt"
    a.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    (folder / "runs").mkdir()
    (folder / "runs" / "log.txt").write_text("kept")
    b.save_pretrained(folder)
    assert torch.equal(logits_of(folder), logits_b)
    assert (folder / "runs" / "log.txt").read_text() == "kept" and (folder / "tokenizer.json").is_file()
    assert oct(folder.stat().st_mode & 0o777) != oct(0o700), "the folder keeps ordinary permissions, not mkdtemp's"
    assert leftovers(folder) == []


def test_a_sharded_save_over_an_unsharded_one_removes_the_stale_weights(tmp_path, two_models):
    _, a, b, _, logits_b = two_models
    folder = tmp_path / "ckpt"
    a.save_pretrained(folder)
    assert (folder / "model.safetensors").is_file()
    b.save_pretrained(folder, max_shard_size="60KB")
    names = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert torch.equal(logits_of(folder), logits_b)


def test_only_model_files_are_replaced_never_other_weight_like_files(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    for name in ("training_args.bin", "adapter_model.safetensors", "model-00001-of-00002.safetensors", "config.json"):
        (folder / name).write_text("old")
    with atomic_folder(folder) as staging:
        (staging / "config.json").write_text("{}")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_model.safetensors", "config.json", "training_args.bin"]


def test_a_failure_inside_the_block_leaves_the_target_untouched(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text('{"old": true}')
    with pytest.raises(KeyboardInterrupt), atomic_folder(folder) as staging:
        (staging / "config.json").write_text('{"new"')  # half-written
        raise KeyboardInterrupt
    assert (folder / "config.json").read_text() == '{"old": true}' and leftovers(folder) == []


def test_incomplete_files_are_refused_before_the_swap(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(CheckpointWriteError, match="config.json"), atomic_folder(folder) as staging:
        (staging / "config.json").write_text('{"model_type": ')
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64)}, str(tmp_path / "w.safetensors"))
    assert safetensors_problem(tmp_path / "w.safetensors") is None
    data = (tmp_path / "w.safetensors").read_bytes()
    with pytest.raises(CheckpointWriteError, match="model.safetensors"), atomic_folder(folder) as staging:
        (staging / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointWriteError, match="shards"), atomic_folder(folder) as staging:
        (staging / "model.safetensors.index.json").write_text('{"weight_map": {"w": "model-00001-of-00002.safetensors"}}')
    verify_checkpoint_files(folder)
    assert (folder / "config.json").read_text() == "{}" and leftovers(folder) == []


def test_staging_left_by_a_dead_process_is_removed_by_the_next_save(tmp_path):
    folder = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stray = tmp_path / f".out{STAGING_TAG}{int(dead.stdout)}-abc"
    stray.mkdir()
    mine = tmp_path / f".out{STAGING_TAG}{os.getpid()}-xyz"
    mine.mkdir()
    remove_dead_staging(folder)
    assert not stray.exists() and mine.exists(), "only a dead process's staging folder goes"


KILLED_SAVE = textwrap.dedent(
    """
    import sys, torch
    from transformers import AutoModelForCausalLM
    import quasar_hf
    from quasar_hf import QuasarConfig
    src, folder = sys.argv[1], sys.argv[2]
    fast = dict(num_calibration_samples=4, calibration_seq_len=64)
    a = AutoModelForCausalLM.from_pretrained(src, quantization_config=QuasarConfig(**fast), dtype=torch.float32)
    b = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=QuasarConfig(**fast, keep_float=["model.layers.0.mlp.down_proj"]), dtype=torch.float32)
    print("ready", flush=True)
    sys.stdin.readline()
    while True:  # every save changes the folder: B over A, then A over B
        b.save_pretrained(folder)
        a.save_pretrained(folder)
    """
)


def test_a_save_killed_at_random_points_leaves_old_or_new_never_a_mix(tmp_path, two_models):
    src, a, _, logits_a, logits_b = two_models
    folder = tmp_path / "ckpt"
    a.save_pretrained(folder)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, src, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        rng = random.Random(0)
        time.sleep(0.3)
        seen = set()
        for _ in range(12):  # stop the saving loop at random points, check the folder, let it go on
            time.sleep(rng.uniform(0.0, 0.05))
            os.kill(proc.pid, signal.SIGSTOP)
            got = logits_of(folder)
            seen.add("a" if torch.equal(got, logits_a) else "b" if torch.equal(got, logits_b) else "mix")
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(rng.uniform(0.0, 0.15))
    finally:
        proc.kill()
        proc.wait()
    assert "mix" not in seen and seen, seen
    got = logits_of(folder)
    assert torch.equal(got, logits_a) or torch.equal(got, logits_b)
    assert [p.name for p in folder.iterdir() if p.name.startswith(".") or "tmp" in p.name] == []
    a.save_pretrained(folder)  # the next save removes what the killed one left beside the folder
    assert leftovers(folder) == [] and torch.equal(logits_of(folder), logits_a)
