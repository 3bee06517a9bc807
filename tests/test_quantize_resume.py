"""Quantization that resumes after a kill (hf/resume_state.py), computes in fp32 on CPUs that emulate
bf16 (smoothquant/math_dtype.py), and reports where its time went (smoothquant/phase_times.py)."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig
from quasar_hf.hf import sequential
from quasar_hf.smoothquant import math_dtype
from tests.helpers.tiny_models import char_tokenizer, tiny_model

FAST = dict(num_calibration_samples=4, calibration_seq_len=64)
LAYERS = 5


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("src")
    tiny_model("qwen2", layers=LAYERS, dtype=torch.bfloat16).save_pretrained(folder)  # q/k/v biases
    char_tokenizer().save_pretrained(folder)
    return str(folder)


def quantize(source: str, **options):
    return AutoModelForCausalLM.from_pretrained(source, quantization_config=QuasarConfig(**FAST, **options), dtype=torch.bfloat16)


class Killed(Exception):
    pass


def _killed_run(source: str, state: str, monkeypatch, kill_at: int) -> None:
    """A run stopped during layer `kill_at`, its state left in `state`."""
    swap = sequential.swap_in_w8a8
    swaps = {"count": 0}

    def dying_swap(*args, **kwargs):
        if swaps["count"] == kill_at:
            raise Killed(f"killed during layer {kill_at}")
        swaps["count"] += 1
        return swap(*args, **kwargs)

    monkeypatch.setattr(sequential, "swap_in_w8a8", dying_swap)
    with pytest.raises(Killed):
        quantize(source, resume_dir=state)
    monkeypatch.setattr(sequential, "swap_in_w8a8", swap)


def test_a_run_killed_at_a_random_layer_resumes_to_bit_identical_weights(source, tmp_path, monkeypatch):
    whole = quantize(source).state_dict()
    kill_at = random.Random(1234).randrange(1, LAYERS)  # a layer after at least one finished
    _killed_run(source, str(tmp_path / "state"), monkeypatch, kill_at)
    resumed_model = quantize(source, resume_dir=str(tmp_path / "state"))
    timing = resumed_model.config.quantization_config.calibration_info["timing"]
    assert len(timing["per_layer_s"]) == LAYERS - kill_at, "only the unfinished layers ran again"
    assert "resume_restore" in timing["total_s"]
    resumed = resumed_model.state_dict()
    assert resumed.keys() == whole.keys()
    different = [k for k in whole if not torch.equal(whole[k], resumed[k])]
    assert not different, different[:5]


def test_a_saved_state_of_other_settings_is_not_used(source, tmp_path):
    quantize(source, resume_dir=str(tmp_path / "state"), alpha=0.5)  # a finished state of another run
    model = quantize(source, resume_dir=str(tmp_path / "state"))
    timing = model.config.quantization_config.calibration_info["timing"]
    assert len(timing["per_layer_s"]) == LAYERS and "resume_restore" not in timing["total_s"]
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, quantize(source).model.layers[0].mlp.down_proj.weight)


def test_calibration_math_dtype_follows_the_cpu_and_is_recorded(source, monkeypatch):
    monkeypatch.setattr(math_dtype, "cpu_has_native_bf16", lambda: False)
    assert math_dtype.calibration_dtype(torch.bfloat16, torch.device("cpu"))[0] == torch.float32
    assert math_dtype.calibration_dtype(torch.float16, torch.device("cpu"))[0] == torch.float32
    assert math_dtype.calibration_dtype(torch.bfloat16, torch.device("cpu"), "model")[0] == torch.bfloat16
    assert math_dtype.calibration_dtype(torch.bfloat16, torch.device("cuda"))[0] == torch.bfloat16
    monkeypatch.setattr(math_dtype, "cpu_has_native_bf16", lambda: True)
    assert math_dtype.calibration_dtype(torch.bfloat16, torch.device("cpu"))[0] == torch.bfloat16
    with pytest.raises(ValueError, match="calibration_dtype must be one of"):
        QuasarConfig(calibration_dtype="fp8")


def test_fp32_calibration_keeps_the_models_dtype_and_reloads_exactly(source, tmp_path):
    """Every saved float tensor in bf16 (scales fp32), the same logits after a reload, and the W8A8
    model no further from the float model than with bf16 calibration (a tiny random model: a
    mechanics check; benchmarks/README.md has the real checkpoints' fidelity)."""
    ids = torch.arange(3, 60)[None]
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)(ids).logits
    errors = {}
    for choice in ("float32", "model"):
        model = quantize(source, calibration_dtype=choice)
        info = model.config.quantization_config.calibration_info
        assert info["math_dtype"] == ("float32" if choice == "float32" else "bfloat16")
        floats = {n: t.dtype for n, t in model.state_dict().items() if t.is_floating_point() and "scale" not in n}
        assert set(floats.values()) == {torch.bfloat16}, floats
        model.save_pretrained(tmp_path / choice)
        with torch.no_grad():
            logits = model(ids).logits.float()
            assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / choice)(ids).logits.float(), logits)
        errors[choice] = ((logits - reference).norm() / reference.norm()).item()
    assert errors["float32"] < 1.1 * errors["model"], errors


def test_fp32_calibration_records_the_activations_a_bf16_model_passes_on(source, monkeypatch):
    """Computed in fp32, every recorded input (abs-max and sampled rows) is a bf16 value, as in the
    deployed bf16 model; the control, with the rounding hooks off, records fp32 values."""
    recorded = []

    def spy(layer, index, local, stats, *args, **kwargs):
        recorded.extend(s for entry in stats.by_module.values() for s in (entry.absmax, entry.samples))
        return smooth_layer(layer, index, local, stats, *args, **kwargs)

    smooth_layer = sequential.smooth_layer
    monkeypatch.setattr(sequential, "smooth_layer", spy)

    def off_bf16_grid() -> int:
        return sum(int((t != t.bfloat16().float()).sum()) for t in recorded)

    quantize(source, calibration_dtype="float32")
    assert recorded and off_bf16_grid() == 0
    recorded.clear()
    monkeypatch.setattr(sequential, "activations_rounded_to", lambda *_: contextlib.nullcontext())
    quantize(source, calibration_dtype="float32")
    assert off_bf16_grid() > 0


def test_the_timing_block_names_every_phase(source):
    from quasar_hf.smoothquant.phase_times import format_timing

    timing = quantize(source, weight_rounding="gptq", rotate=["down_proj"]).config.quantization_config.calibration_info["timing"]
    phases = set(timing["total_s"])
    assert {"capture_inputs", "statistics_forward", "smoothing_alpha_search", "gptq_rounding", "rotation", "swap_in"} <= phases
    assert len(timing["per_layer_s"]) == LAYERS
    table = format_timing(timing)
    assert "statistics_forward" in table and f"({LAYERS} layers)" in table


def test_the_cli_says_how_to_resume_continues_a_killed_run_and_profiles(source, tmp_path, monkeypatch, capsys):
    import os

    from quasar_hf.cli import main

    out = tmp_path / "out"
    argv = ["quantize", source, "--out", str(out), "--num-samples", "2", "--seq-len", "32", "--weight-rounding", "nearest"]
    swap = sequential.swap_in_w8a8
    calls = {"count": 0}

    def dying_swap(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] == 3:
            raise Killed("killed during layer 2")
        return swap(*args, **kwargs)

    monkeypatch.setattr(sequential, "swap_in_w8a8", dying_swap)
    assert main(argv) == 1
    printed = capsys.readouterr()
    assert "run the same command again to continue from the last finished layer" in printed.out
    assert "stopped after 2 finished decoder layers; run the same command again to resume" in printed.err
    assert os.path.isfile(f"{out}.partial/progress.json") and not out.exists()
    monkeypatch.setattr(sequential, "swap_in_w8a8", swap)
    assert main([*argv, "--profile"]) == 0
    printed = capsys.readouterr().out
    assert "resume_restore" in printed and "statistics_forward" in printed and "calibration computed in" in printed
    assert out.is_dir() and not os.path.exists(f"{out}.partial"), "the state goes once the checkpoint is saved"


def test_a_process_killed_by_sigkill_resumes_to_the_same_checkpoint(source, tmp_path):
    """A real kill (SIGKILL, no cleanup) of `quasar-hf quantize` once its first layer is saved, at a
    seeded random moment after; the rerun's weights equal an uninterrupted run's, tensor for tensor."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    def command(out):
        options = ["--num-samples", "16", "--seq-len", "128", "--dtype", "bfloat16"]
        return [sys.executable, "-m", "quasar_hf.cli", "quantize", source, "--out", str(out), *options]

    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    subprocess.run(command(tmp_path / "whole"), check=True, capture_output=True, env=env, timeout=600)
    out = tmp_path / "killed"
    process = subprocess.Popen(command(out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    progress = f"{out}.partial/progress.json"
    deadline = time.monotonic() + 300
    while not os.path.exists(progress) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(random.Random(7).uniform(0.0, 0.2))
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert not out.exists() or process.returncode == 0, "killed before the save"
    assert os.path.isdir(f"{out}.partial")
    finished = subprocess.run([*command(out), "--profile"], check=True, capture_output=True, text=True, env=env, timeout=600)
    assert "resume_restore" in finished.stdout, "the rerun continued the saved state"
    whole, resumed = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a weight byte: the file still parses, its values differ
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, victim",
    [(_truncate, "layer_0002.safetensors"), (_truncate, "hidden_0003.safetensors"), (_flip_last_byte, "layer_0001.safetensors")],
    ids=["truncated-layer", "truncated-hidden", "flipped-byte"],
)
def test_a_damaged_state_is_reported_once_and_the_run_starts_over(source, tmp_path, monkeypatch, damage, victim):
    """Every state file is checked against the SHA-256 progress.json recorded: a damaged one is named
    in one warning, the state is deleted, and the run gives an uninterrupted run's weights (never a
    mix with the damaged tensors, never the same failure on each rerun)."""
    state = tmp_path / "state"
    _killed_run(source, str(state), monkeypatch, kill_at=3)
    damage(state / victim)
    with pytest.warns(UserWarning, match=rf"{victim}.*(SHA-256|cannot be read).*quantizing from layer 0") as caught:
        model = quantize(source, resume_dir=str(state))
    assert sum("not resuming" in str(w.message) for w in caught) == 1
    timing = model.config.quantization_config.calibration_info["timing"]
    assert len(timing["per_layer_s"]) == LAYERS and "resume_restore" not in timing["total_s"]
    whole = quantize(source).state_dict()
    resumed = model.state_dict()
    assert [k for k in whole if not torch.equal(whole[k], resumed[k])] == []


def test_a_state_of_other_settings_or_an_unreadable_progress_file_is_reported(source, tmp_path, monkeypatch):
    state = tmp_path / "state"
    _killed_run(source, str(state), monkeypatch, kill_at=2)
    with pytest.warns(UserWarning, match="holds the state of another run"):
        quantize(source, resume_dir=str(state), alpha=0.5, seed=1)
    _killed_run(source, str(state), monkeypatch, kill_at=2)
    (state / "progress.json").write_text('{"format": 3, "next')
    with pytest.warns(UserWarning, match=r"progress.json cannot be read"):
        quantize(source, resume_dir=str(state))


def test_a_failed_save_keeps_the_finished_layers_and_says_so(source, tmp_path, monkeypatch, capsys):
    """A full disk at the save: OUT.partial stays (the rerun only restores and saves) and the message
    names it, the cause and both ways out."""
    import errno
    import os

    from quasar_hf.cli import main
    from quasar_hf.commands import loading

    out = tmp_path / "out"
    argv = ["quantize", source, "--out", str(out), "--num-samples", "2", "--seq-len", "32", "--weight-rounding", "nearest"]

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loading, "save_quantized", full_disk)
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert f"saving to {out} failed" in err and "free disk space" in err and f"delete {out}.partial" in err
    monkeypatch.undo()
    assert main([*argv, "--profile"]) == 0
    printed = capsys.readouterr().out
    assert "resume_restore" in printed and "statistics_forward" not in printed, "the rerun only restored and saved"
    assert out.is_dir() and not os.path.exists(f"{out}.partial")


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda p: p.update(next_layer="2"), "next_layer"),
        (lambda p: p.update(next_layer=99), "next_layer"),
        (lambda p: p["gathered"].update(prescaled=["model.layers.0.mlp.nope"]), "gathered.prescaled"),
        (lambda p: p["gathered"].update(rotated=[7]), "gathered.rotated"),
        (lambda p: p["gathered"].update(alphas={"0.input_layernorm": "0.5"}), "alpha"),
        (lambda p: p["gathered"].update(alphas={"9.input_layernorm": 0.5}), "alpha"),
        (lambda p: p["gathered"].pop("alphas"), "gathered"),
        (lambda p: p.update(generator="not base64!"), "generator"),
    ],
    ids=[
        "next-layer-text",
        "next-layer-past-the-end",
        "unknown-prescaled",
        "rotated-number",
        "alpha-text",
        "alpha-of-unfinished-layer",
        "no-alphas",
        "generator",
    ],
)
def test_a_hand_edited_progress_file_is_reported_once_and_the_run_starts_over(source, tmp_path, monkeypatch, edit, named):
    """A field of the wrong type, or one naming what the model lacks, cannot be vouched for by the files'
    digests: one warning names it, the state is deleted, and the result is an uninterrupted run's."""
    state = tmp_path / "state"
    _killed_run(source, str(state), monkeypatch, kill_at=2)
    progress = json.loads((state / "progress.json").read_text())
    edit(progress)
    (state / "progress.json").write_text(json.dumps(progress))
    with pytest.warns(UserWarning, match=rf"progress.json: .*{named}.*quantizing from layer 0") as caught:
        model = quantize(source, resume_dir=str(state))
    assert sum("not resuming" in str(w.message) for w in caught) == 1
    whole = quantize(source).state_dict()
    resumed = model.state_dict()
    assert [k for k in whole if not torch.equal(whole[k], resumed[k])] == []
    assert model.config.quantization_config.searched_alphas == quantize(source).config.quantization_config.searched_alphas


def test_starting_over_deletes_only_the_states_own_files(source, tmp_path, monkeypatch):
    """A foreign state beside a saved model and a user's files: only layer_NNNN, hidden_NNNN and progress.json go."""
    state = tmp_path / "state"
    _killed_run(source, str(state), monkeypatch, kill_at=2)
    keep = {"model.safetensors": b"weights", "notes.txt": b"mine", "layer_final.safetensors": b"x", "adapter.safetensors": b"y"}
    for name, data in keep.items():
        (state / name).write_bytes(data)
    with pytest.warns(UserWarning, match="holds the state of another run"):
        quantize(source, resume_dir=str(state), alpha=0.5, seed=1)
    for name, data in keep.items():
        assert (state / name).read_bytes() == data
