"""`QuasarConfig(backend=...)` passed when loading a saved Quasar checkpoint is the backend the
W8A8Linear modules run (it is the config's one loading attribute)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig, W8A8Linear
from quasar_hf.ops import dispatch
from tests.tiny_models import save_tiny

IDS = torch.tensor([[5, 17, 33, 2, 71, 40, 9, 88, 12, 3]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Quasar checkpoint saved with backend="auto", and its logits."""
    root = tmp_path_factory.mktemp("load_backend")
    src = save_tiny(root / "src", "llama")
    config = QuasarConfig(num_calibration_samples=4, calibration_seq_len=64)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=torch.float32)
    model.save_pretrained(root / "quasar")
    with torch.no_grad():
        logits = model(IDS).logits
    return root / "quasar", logits


def _counting(monkeypatch, name: str) -> list[int]:
    """Count the calls that reach backend `name`'s kernel."""
    calls = []
    entry = dispatch._TABLE[name]

    def run(*args, **kwargs):
        calls.append(1)
        return entry.run(*args, **kwargs)

    group_bind = entry.bind_group  # a folded norm's consumers (q/k/v, gate/up) run as one group call

    def bind_group(weights, *args, **kwargs):
        group = group_bind(weights, *args, **kwargs)

        def counted(x):
            calls.extend([1] * len(weights))  # one output per consumer linear
            return group(x)

        return counted

    monkeypatch.setitem(dispatch._TABLE, name, dataclasses.replace(entry, run=run, run_prepacked=run, bind_group=bind_group))
    return calls


def test_backend_passed_at_load_is_the_one_in_use(saved, monkeypatch):
    path, logits = saved
    calls = _counting(monkeypatch, "reference")
    with pytest.warns(UserWarning, match="loading attributes"):
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=QuasarConfig(backend="reference"))
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert linears and all(m.backend == "reference" for m in linears)
    assert model.config.quantization_config.backend == "reference"
    with torch.no_grad():
        again = model(IDS).logits
    assert len(calls) == len(linears), "every W8A8 linear must run on the backend passed at load time"
    assert torch.equal(again, logits), "the reference backend computes the same bits as the saved model's"


def test_reload_without_a_config_keeps_the_saved_backend(saved):
    path, _ = saved
    model = AutoModelForCausalLM.from_pretrained(path)
    assert {m.backend for m in model.modules() if isinstance(m, W8A8Linear)} == {"auto"}
