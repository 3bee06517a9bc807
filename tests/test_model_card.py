"""Model card rendering: metadata valid for huggingface_hub, config stated, measured sections
only when measured, and the shipped SmolLM2 card is well-formed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from quasar_hf.hub.model_card import (
    REQUIRED_TAGS,
    is_quasar_card,
    render_model_card,
    validate_model_card,
    write_model_card,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
BASE = {"quant_method": "quasar", "bits": 8, "alpha": 0.5, "modules_to_not_convert": ["lm_head"], "version": "1"}


def test_metadata_is_valid_and_tagged():
    text = render_model_card(BASE, repo_id="me/tiny-quasar", base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    data = ModelCard(text).data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data["pipeline_tag"] == "text-generation"
    assert set(REQUIRED_TAGS) <= set(data["tags"])
    assert is_quasar_card(text)


def test_unmeasured_card_has_no_numbers_sections():
    text = render_model_card(BASE, repo_id="me/x")
    assert "## Measured fidelity" not in text and "## Measured speed" not in text
    assert "No fidelity or speed measurements" in text
    assert "base_model" not in ModelCard(text).data.to_dict()


def test_config_and_measurements_are_rendered():
    qconfig = dict(
        BASE,
        alpha="auto",
        searched_alphas={"model.layers.0.input_layernorm": 0.7},
        calibration_info={"source": "built-in python docs", "num_samples": 32, "seq_len": 512},
        measured={
            "perplexity_ratio": 1.0123,
            "top1_agreement": 0.9512,
            "mean_acceptance_length": 1.41,
            "speedup_vs_bf16_verify": 1.27,
            "command": "quasar-hf eval A --reference B",
        },
    )
    text = render_model_card(qconfig, repo_id="me/x")
    assert "| `model.layers.0.input_layernorm` | 0.7 |" in text
    assert "built-in python docs (32 samples, 512 tokens each)" in text
    assert "| Perplexity ratio (W8A8 / reference) | 1.012 |" in text
    assert "| Top-1 agreement with the reference | 0.9512 |" in text
    assert "| Mean acceptance length L (W8A8 verifier) | 1.41 |" in text
    assert "quasar-hf eval A --reference B" in text
    assert "No fidelity or speed measurements" not in text


def test_chat_template_switches_the_usage_snippet():
    with_chat = render_model_card(BASE, repo_id="me/x", has_chat_template=True)
    without = render_model_card(BASE, repo_id="me/x", has_chat_template=False)
    assert "apply_chat_template" in with_chat and "apply_chat_template" not in without


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="quant_method"):
        render_model_card({"quant_method": "gptq"}, repo_id="me/x")
    with pytest.raises(ValueError, match="tags"):
        validate_model_card("---\nlibrary_name: transformers\ntags: [w8a8]\n---\nhello\n")
    with pytest.raises(ValueError, match="library_name"):
        validate_model_card("---\nlibrary_name: diffusers\n---\nhello\n")


def test_write_model_card_policy(tmp_path):
    ours = render_model_card(BASE, repo_id="me/x")
    assert write_model_card(tmp_path, ours).name == "README.md"
    assert write_model_card(tmp_path, ours).name == "README.md"  # our own card: refreshed in place
    (tmp_path / "README.md").write_text("mine")
    with pytest.warns(UserWarning, match="not written by quasar_hf"):
        assert write_model_card(tmp_path, ours).name == "QUASAR_MODEL_CARD.md"
    assert (tmp_path / "README.md").read_text() == "mine"


def test_shipped_smollm2_card_is_valid_and_cites_its_command():
    text = (REPO_ROOT / "model_cards" / "SmolLM2-135M-Instruct-quasar-w8a8.md").read_text()
    card = validate_model_card(text)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert re.search(r"quasar-hf (eval|bench)", text), "the real card must show the command that produced its numbers"


def test_usage_snippet_is_python_that_compiles():
    text = render_model_card(BASE, repo_id="me/x", has_chat_template=True)
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    compile(snippet, "card-snippet", "exec")


@pytest.mark.parametrize("has_chat_template", [True, False])
def test_rendered_card_passes_the_formatter_ci_runs(has_chat_template, tmp_path):
    """Cards written by --record land in model_cards/, which CI checks with `ruff format --check`."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed")
    card = tmp_path / "README.md"
    card.write_text(render_model_card(BASE, repo_id="me/x", has_chat_template=has_chat_template))
    result = subprocess.run(
        [ruff, "format", "--check", "--config", str(REPO_ROOT / "pyproject.toml"), str(card)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_embedded_checkpoint_folders_map_to_their_hub_ids():
    from quasar_hf.hub.model_card import base_model_from_name

    assert base_model_from_name("/cache/Qwen2.5-Coder-0.5B-Instruct-bf16") == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert base_model_from_name("/cache/gemma-3-270m-bf16") == "google/gemma-3-270m"
    assert base_model_from_name("/cache/SmolLM2-135M-Instruct-bf16") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model_from_name("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
