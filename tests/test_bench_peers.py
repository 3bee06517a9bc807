"""Peer variants (torchao W8A8 through Transformers): built only when torchao imports, named with its
version, and checked for exactness against their own plain greedy output."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf.bench import peers
from tests.tiny_models import save_tiny

PROMPT = torch.tensor([[5, 17, 33, 2, 71, 40, 9, 88, 12, 3, 5, 17, 33, 2, 71]])


def test_missing_package_gives_an_install_hint(monkeypatch):
    monkeypatch.setattr(peers, "available_peers", lambda: {})
    with pytest.raises(ValueError, match="pip install --no-deps torchao"):
        peers.build_peer_variants(["bf16_generate", "ao_w8a8"], torch.nn.Linear(2, 2))
    assert peers.build_peer_variants(["bf16_generate", "quasar_ngram"], torch.nn.Linear(2, 2)) == {}
    assert peers.report_names(["ao_w8a8", "quasar_ngram"]) == {"ao_w8a8": "ao_w8a8", "quasar_ngram": "quasar_ngram"}


def test_exactness_compares_each_peer_with_its_plain_greedy_run():
    tokens = {"ao_w8a8": [[1, 2, 3]], "ao_w8a8_prompt_lookup": [[1, 2, 3]], "quasar_ngram": [[9]]}
    assert peers.exactness(tokens) == {"ao_w8a8": True, "ao_w8a8_prompt_lookup": True}
    assert peers.exactness(dict(tokens, ao_w8a8_prompt_lookup=[[1, 2, 4]]))["ao_w8a8_prompt_lookup"] is False
    assert peers.exactness({"ao_w8a8_prompt_lookup": [[1]]}) == {"ao_w8a8_prompt_lookup": None}


def test_torchao_peers_run_on_a_tiny_model(tmp_path):
    pytest.importorskip("torchao", reason="torchao is an optional peer (pip install --no-deps torchao==0.18.0)")
    reference = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "src"), dtype=torch.float32).eval()
    variants = peers.build_peer_variants(list(peers.TORCHAO_PEERS) + ["quasar_ngram"], reference)
    assert set(variants) == set(peers.TORCHAO_PEERS)
    tokens = {name: [generate(PROMPT, 12)[0]] for name, generate in variants.items()}
    assert all(len(t[0]) == 12 for t in tokens.values())
    assert set(peers.exactness(tokens)) == set(peers.TORCHAO_PEERS)  # the value is what the benchmark reports
    names = peers.report_names(["ao_w8a8"])
    assert names["ao_w8a8"].startswith("ao_w8a8 (torchao ")
