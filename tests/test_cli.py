"""The `quasar-hf` CLI: help everywhere, a real quantize -> generate -> export -> eval on a tiny
model, the demo path, and user errors as one line with exit code 2 (runtime failures: 1)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from quasar_hf.cli import main
from quasar_hf.commands.parser import build_parser
from tests.helpers.hub import make_tiny_checkpoint

SUBCOMMANDS = ("quantize", "generate", "export", "bench", "eval", "demo")
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "base")


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text("def add(a, b):\n    return a + b\n" * 40 + "The quick brown fox jumps over the lazy dog. " * 40)
    return path


@pytest.fixture(scope="module")
def quantized(tiny, calibration_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "tiny-quasar"
    code = main(
        [
            "quantize",
            str(tiny),
            "--out",
            str(out),
            "--alpha",
            "0.5",
            "--num-samples",
            "2",
            "--seq-len",
            "32",
            "--calibration-dataset",
            str(calibration_file),
            "--dtype",
            "float32",
        ]
    )
    assert code == 0
    return out


def test_every_subcommand_has_help(capsys):
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        expected = "usage: quasar-hf bench" if name == "bench" else "usage: quasar-hf " + name
        assert expected in capsys.readouterr().out  # bench passes its options through to the runner
    assert set(SUBCOMMANDS) <= set(build_parser()._subparsers._group_actions[0].choices)


def test_console_script_runs():
    result = subprocess.run([str(VENV_BIN / "quasar-hf"), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "quantize" in result.stdout


def test_quantize_writes_a_quasar_checkpoint_with_card(quantized):
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "quasar"
    assert config["quantization_config"]["alpha"] == 0.5
    assert config["quantization_config"]["rotate"] == ["down_proj"]  # the default
    assert config["quantization_config"]["rotated_modules"] == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    card = (quantized / "README.md").read_text()
    assert "quasar-hf:model-card" in card and "apply_chat_template" in card  # the tokenizer has a chat template
    assert (quantized / "tokenizer.json").is_file()


def test_quantize_push_to_hub(tiny, calibration_file, tmp_path, capsys):
    import httpx2
    import huggingface_hub
    from huggingface_hub.utils._http import default_client_factory

    from tests.helpers.hub import HubStandIn

    hub = HubStandIn()
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(hub.handler)))
    try:
        code = main(
            [
                "quantize",
                str(tiny),
                "--out",
                str(tmp_path / "q"),
                "--alpha",
                "0.5",
                "--num-samples",
                "1",
                "--seq-len",
                "32",
                "--calibration-dataset",
                str(calibration_file),
                "--dtype",
                "float32",
                "--push-to-hub",
                "tiny-cli",
                "--token",
                "hf_test_token",
            ]
        )
    finally:
        huggingface_hub.set_client_factory(default_client_factory)
    assert code == 0
    files = hub.repos["tester/tiny-cli"]
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert b"tester/tiny-cli" in files["README.md"] and "pushed to" in capsys.readouterr().out


def test_generate_quasar_equals_plain_greedy(quantized, capsys):
    prompt = ["--prompt", "abc abc abc abc", "--max-new-tokens", "16"]
    assert main(["generate", str(quantized), *prompt]) == 0
    with_quasar = capsys.readouterr()
    assert main(["generate", str(quantized), *prompt, "--no-quasar"]) == 0
    plain = capsys.readouterr()
    assert with_quasar.out == plain.out  # greedy speculative decoding is exact
    assert "mean acceptance length L" in with_quasar.err and "tokens/s" in plain.err


def test_generate_streams(quantized, capsys):
    assert main(["generate", str(quantized), "--prompt", "abc abc", "--max-new-tokens", "6", "--stream"]) == 0
    assert "quasar: 6 tokens" in capsys.readouterr().err


def test_export_writes_compressed_tensors(quantized, tmp_path, capsys):
    assert main(["export", str(quantized), "--format", "compressed-tensors", "--out", str(tmp_path / "ct")]) == 0
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    # the default checkpoint rotates down_proj: exported as an input transform, and said so
    (scheme,) = config["transform_config"]["config_groups"].values()
    assert all(name.endswith("mlp.down_proj") for name in scheme["apply"][0]["targets"])
    assert "input transform" in capsys.readouterr().out
    assert (tmp_path / "ct" / "tokenizer.json").is_file()


def test_eval_reports_fidelity(quantized, tiny, calibration_file, tmp_path, capsys):
    report = tmp_path / "fidelity.json"
    code = main(
        [
            "eval",
            str(quantized),
            "--reference",
            str(tiny),
            "--text-file",
            str(calibration_file),
            "--seq-len",
            "32",
            "--max-windows",
            "4",
            "--dtype",
            "float32",
            "--json",
            str(report),
        ]
    )
    assert code == 0
    scores = json.loads(report.read_text())["next_token"]
    assert 0.9 < scores["perplexity_ratio"] < 1.1  # W8A8 of a tiny random model stays close to fp32
    assert "top-1 agreement" in capsys.readouterr().out


def test_eval_record_puts_numbers_in_config_and_card(quantized, tiny, calibration_file, tmp_path):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(quantized, folder)
    code = main(
        [
            "eval",
            str(folder),
            "--reference",
            str(tiny),
            "--text-file",
            str(calibration_file),
            "--seq-len",
            "32",
            "--max-windows",
            "2",
            "--dtype",
            "float32",
            "--record",
        ]
    )
    assert code == 0
    measured = json.loads((folder / "config.json").read_text())["quantization_config"]["measured"]
    assert measured["command"].startswith("quasar-hf eval") and measured["num_tokens"] > 0
    card = (folder / "README.md").read_text()
    assert "## Measured fidelity" in card and f"{measured['perplexity_ratio']:.4g}" in card
    assert main(["eval", str(tiny), "--reference", str(tiny), "--record"]) == 2  # not a Quasar folder


def test_bench_passes_options_through(quantized, tiny, tmp_path, capsys):
    code = main(
        [
            "bench",
            "--model",
            str(tiny),
            "--quantized",
            str(quantized),
            "--suites",
            "grounded",
            "--limit-per-suite",
            "1",
            "--max-new-tokens",
            "4",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--variants",
            "bf16_generate,quasar_ngram",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    result = json.loads((tmp_path / "bench_cpu.json").read_text())
    assert set(result["variants"]) == {"bf16_generate", "quasar_ngram"}
    assert "wrote" in capsys.readouterr().out


def test_demo_path_on_a_tiny_model(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QUASAR_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("quasar_hf.models.smollm2_135m_instruct", lambda rebuild=False: str(tiny))
    from quasar_hf.commands import demo

    monkeypatch.setattr(demo, "quantize_options", lambda: {"alpha": 0.5, "num_calibration_samples": 2, "calibration_seq_len": 32})
    numbers = demo.run_demo(max_new_tokens=8)
    out = capsys.readouterr().out
    assert "without Quasar" in out and "with Quasar" in out and "speedup:" in out
    assert numbers["mean_acceptance_length"] >= 1.0
    cached = tmp_path / "cache" / demo.QUANTIZED_NAME / "config.json"
    assert cached.is_file()  # cached for the next run

    config = json.loads(cached.read_text())  # a cache from an incompatible version is rebuilt, not fatal
    config["quantization_config"]["draft_dtype"] = "no-such-dtype"
    cached.write_text(json.dumps(config))
    demo.run_demo(max_new_tokens=4)
    assert json.loads(cached.read_text())["quantization_config"]["draft_dtype"] != "no-such-dtype"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["quantize", "TMP/missing/model", "--out", "TMP/never"], "does not exist"),
        (["generate", "TINY", "--prompt", "x", "--drafter", "assistant"], "needs --assistant"),
        (["export", "TINY", "--out", "TMP/never"], "not a Quasar W8A8 checkpoint"),
        (["eval", "TINY", "--reference", "TINY", "--text-file", "TMP/missing.txt"], "cannot read --text-file"),
    ],
)
def test_user_errors_exit_2_with_one_line(argv, message, tiny, capsys, tmp_path):
    argv = [str(tiny) if part == "TINY" else part.replace("TMP", str(tmp_path)) for part in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ["quantize", "m", "--out", "o", "--alpha", "1.5"],
        ["generate", "m", "--prompt", "x", "--drafter", "beam"],
        ["quantize", "m"],
        ["generate", "m", "--prompt", "x", "--max-new-tokens", "0"],
    ],
)
def test_argparse_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2


def test_runtime_failure_exits_1_and_debug_shows_traceback(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert main(["generate", str(broken), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("quasar-hf generate: error:") and "Traceback" not in err
    assert main(["generate", str(broken), "--prompt", "x", "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_generate_without_tokenizer_files_is_a_usage_error(quantized, tmp_path, capsys):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(quantized / name, bare / name)
    assert main(["generate", str(bare), "--prompt", "abc", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "has no tokenizer files" in err and "Traceback" not in err


def test_eval_with_tasks_goes_to_lm_eval(capsys):
    """`eval MODEL --tasks ...` is lm-eval's command line (its own options), not the fidelity eval."""
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "some-model", "--tasks", "quasar_tiny_mc", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--tasks" in out and "--plain-w8a8" in out and "--max-windows" not in out


def test_rotate_option_parses_names_and_refuses_others():
    from quasar_hf.commands.parser import rotate_value

    assert rotate_value("none") == [] and rotate_value("down_proj,o_proj") == ["down_proj", "o_proj"]
    for bad in ("q_proj", "", "down_proj,gate"):
        with pytest.raises(argparse.ArgumentTypeError, match="--rotate takes"):
            rotate_value(bad)
