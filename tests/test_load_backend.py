"""Choosing the backend of a saved Quasar checkpoint: `quasar_hf.set_backend(model, name)` after loading
switches every W8A8Linear (and is saved), checks before it changes anything, and no Transformers
module-level state is changed to make a load-time override work."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig, W8A8Linear, set_backend
from quasar_hf.ops import dispatch
from tests.helpers.tiny_models import save_tiny

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

    def run_folded(*args):  # a norm-folded group (q/k/v, gate/up) runs its stacked linear's folded form
        calls.append(1)
        return entry.run_folded(*args)

    monkeypatch.setitem(dispatch._TABLE, name, dataclasses.replace(entry, run=run, run_prepacked=run, run_folded=run_folded))
    return calls


def test_set_backend_after_load_is_the_one_in_use(saved, monkeypatch):
    path, logits = saved
    model = AutoModelForCausalLM.from_pretrained(path)
    calls = _counting(monkeypatch, "reference")
    assert set_backend(model, "reference") == len([m for m in model.modules() if isinstance(m, W8A8Linear)])
    linears = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert linears and all(m.backend == "reference" for m in linears)
    assert model.config.quantization_config.backend == "reference"
    with torch.no_grad():
        again = model(IDS).logits
    assert len(calls) == len(linears), "every W8A8 linear must run on the backend chosen with set_backend"
    assert torch.equal(again, logits), "the reference backend computes the same bits as the saved model's"


def test_set_backend_is_saved_with_the_model(saved, tmp_path):
    path, _ = saved
    model = AutoModelForCausalLM.from_pretrained(path)
    set_backend(model, "reference")
    model.save_pretrained(tmp_path / "again")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert {m.backend for m in reloaded.modules() if isinstance(m, W8A8Linear)} == {"reference"}


def test_set_backend_checks_before_changing_anything(saved, monkeypatch):
    path, _ = saved
    model = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="unknown backend 'fast'.*'auto'"):
        set_backend(model, "fast")
    entry = dispatch._TABLE["torch"]  # a backend that cannot run here is refused, naming why
    monkeypatch.setitem(dispatch._TABLE, "torch", dataclasses.replace(entry, unavailable_reason=lambda device_type: "no kernel"))
    with pytest.raises(ValueError, match="no kernel"):
        set_backend(model, "torch")
    assert {m.backend for m in model.modules() if isinstance(m, W8A8Linear)} == {"auto"}
    assert model.config.quantization_config.backend == "auto"
    with pytest.raises(ValueError, match="needs a Quasar model"):
        set_backend(torch.nn.Linear(2, 2), "reference")


def test_loading_changes_no_transformers_module_state(saved):
    from transformers.quantizers import auto

    before = {name: getattr(auto, name) for name in dir(auto) if name.isupper()}
    AutoModelForCausalLM.from_pretrained(saved[0])
    after = {name: getattr(auto, name) for name in dir(auto) if name.isupper()}
    assert before.keys() == after.keys() and all(after[name] is before[name] for name in before)
    assert QuasarConfig not in getattr(auto, "LOADING_ATTRIBUTES_CONFIG_TYPES", ())


def test_reload_without_a_config_keeps_the_saved_backend(saved):
    path, _ = saved
    model = AutoModelForCausalLM.from_pretrained(path)
    assert {m.backend for m in model.modules() if isinstance(m, W8A8Linear)} == {"auto"}
