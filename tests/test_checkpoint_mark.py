"""A saved Quasar checkpoint is refused by Transformers without quasar_hf (hf/checkpoint_config.py).

Without the mark, Transformers skips the unknown quant_method and loads the int8 weights into float
Linears (garbage logits). The subprocesses here load as a fresh user would: quasar_hf not importable
(`sys.modules` blocks it), or installed but not imported.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from quasar_hf import QuasarConfig
from quasar_hf.cli import main
from quasar_hf.hf.checkpoint_config import BASE_KEY, CODE_FILE, MODEL_TYPE, unmarked
from tests.helpers.tiny_models import char_tokenizer, save_tiny

IDS = [[1, 5, 9, 13, 2, 7]]

LOAD = """
import sys
if sys.argv[2] == "absent":
    sys.modules["quasar_hf"] = None  # as in an environment without the package
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
options = {"trust_remote_code": True} if sys.argv[3] == "trust" else {}
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
print("TOKENIZER", type(tokenizer).__name__)
try:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], **options)
except Exception as error:
    print("REFUSED", type(error).__name__, str(error).replace("\\n", " "))
else:
    logits = model(torch.tensor(IDS)).logits
    torch.save(logits, sys.argv[1] + "/subprocess_logits.pt")
    print("LOADED", type(model).__name__, type(model.config).__name__)
""".replace("IDS", repr(IDS))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("mark")
    source = save_tiny(root / "src", "llama", dtype=torch.bfloat16)
    config = QuasarConfig(num_calibration_samples=4, calibration_seq_len=32)
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16)
    model.save_pretrained(root / "quasar")
    char_tokenizer().save_pretrained(root / "quasar")
    return root / "quasar", model(torch.tensor(IDS)).logits


def _load_in_subprocess(folder, package: str, trust: bool) -> str:
    out = subprocess.run(
        [sys.executable, "-c", LOAD, str(folder), package, "trust" if trust else "plain"],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert "TOKENIZER" in out.stdout, out.stderr[-2000:]
    return out.stdout


def test_a_saved_checkpoint_is_marked_and_reloads_as_its_own_class(saved):
    folder, logits = saved
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE and config[BASE_KEY] == "llama"
    assert config["auto_map"] == {"AutoConfig": "quasar_hf_config.QuasarCheckpointConfig"}
    assert (folder / CODE_FILE).is_file()
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.model_type == "llama"
    assert not hasattr(model.config, "auto_map") and not hasattr(model.config, BASE_KEY)
    assert torch.equal(model(torch.tensor(IDS)).logits, logits)


def test_without_the_package_transformers_refuses_and_names_quasar_hf(saved):
    folder, _ = saved
    plain = _load_in_subprocess(folder, "absent", trust=False)
    assert "REFUSED ValueError" in plain and "trust_remote_code=True" in plain, plain
    trusted = _load_in_subprocess(folder, "absent", trust=True)
    assert "REFUSED ImportError" in trusted and "quasar_hf" in trusted and "pip install quasar-hf" in trusted, trusted


def test_with_the_package_installed_trust_remote_code_loads_it_without_the_import(saved):
    folder, logits = saved
    printed = _load_in_subprocess(folder, "installed", trust=True)
    assert "LOADED LlamaForCausalLM LlamaConfig" in printed, printed
    assert torch.equal(torch.load(folder / "subprocess_logits.pt"), logits)


def test_a_marked_config_without_its_quantization_config_is_refused(saved, tmp_path):
    folder, _ = saved
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    with pytest.raises(ValueError, match=r'model_type "quasar_hf".*no quantization_config.*Restore the config.json'):
        unmarked(config)
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in folder.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no quantization_config"):
        AutoModelForCausalLM.from_pretrained(broken)


def test_an_unmarked_checkpoint_loads_as_before_and_the_mark_command_marks_it(saved, tmp_path, capsys):
    folder, logits = saved
    old = tmp_path / "old"
    old.mkdir()
    for item in folder.iterdir():
        if item.name != CODE_FILE:
            (old / item.name).write_bytes(item.read_bytes())
    (old / "config.json").write_text(json.dumps(unmarked(json.loads((folder / "config.json").read_text()))))
    assert torch.equal(AutoModelForCausalLM.from_pretrained(old)(torch.tensor(IDS)).logits, logits)
    assert main(["mark", str(old)]) == 0
    assert "marked" in capsys.readouterr().out
    assert json.loads((old / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    assert torch.equal(AutoModelForCausalLM.from_pretrained(old)(torch.tensor(IDS)).logits, logits)
    assert main(["mark", str(old)]) == 0 and "already marked" in capsys.readouterr().out
    AutoTokenizer.from_pretrained(old)


def test_the_mark_command_refuses_a_folder_that_is_not_a_quasar_checkpoint(tmp_path, capsys):
    plain = save_tiny(tmp_path / "plain")
    before = (tmp_path / "plain" / "config.json").read_text()
    assert main(["mark", plain]) != 0
    assert "is not a Quasar checkpoint" in capsys.readouterr().err
    assert (tmp_path / "plain" / "config.json").read_text() == before


def test_a_config_with_its_own_custom_config_class_is_saved_unmarked_with_a_warning(saved, tmp_path, capsys):
    """The mark's AutoConfig entry would replace a remote-code config class: the save warns and leaves
    config.json as Transformers wrote it; the mark command refuses it unchanged."""
    folder, _ = saved
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.config.auto_map = {"AutoConfig": "configuration_custom.CustomConfig"}
    with pytest.warns(UserWarning, match=r"without the mark.*configuration_custom\.CustomConfig"):
        model.save_pretrained(tmp_path / "custom")
    config = json.loads((tmp_path / "custom" / "config.json").read_text())
    assert config["model_type"] == "llama" and not (tmp_path / "custom" / CODE_FILE).exists()
    assert main(["mark", str(tmp_path / "custom")]) != 0
    assert "cannot be marked" in capsys.readouterr().err
    assert json.loads((tmp_path / "custom" / "config.json").read_text()) == config


def test_a_model_class_named_directly_loads_it_without_the_type_mismatch_warning(saved, caplog):
    """`transformers serve` loads with the class (LlamaForCausalLM.from_pretrained); Transformers' warning that
    the config's type differs is dropped for Quasar checkpoints only (it is right once quasar_hf is imported)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder, logits = saved
    with caplog.at_level("WARNING"):
        model = LlamaForCausalLM.from_pretrained(folder)
        assert torch.equal(model(torch.tensor(IDS)).logits, logits)
        other = json.loads((folder / "config.json").read_text())
        other.update(model_type="mistral")  # any other mismatch is still reported
        LlamaConfig.from_dict({k: v for k, v in other.items() if k != "quantization_config"})
        (folder.parent / "mistral").mkdir(exist_ok=True)
        (folder.parent / "mistral" / "config.json").write_text(json.dumps(other))
        LlamaConfig.from_pretrained(folder.parent / "mistral")
    assert "of type `quasar_hf`" not in caplog.text
    assert "of type `mistral` to instantiate" in caplog.text
