"""Peer variants (torchao W8A8 through Transformers): built only when torchao imports, named with its
version, and checked for exactness against their own plain greedy output."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf.bench import peers
from tests.helpers.tiny_models import save_tiny

PROMPT = torch.tensor([[5, 17, 33, 2, 71, 40, 9, 88, 12, 3, 5, 17, 33, 2, 71]])


def test_missing_package_gives_an_install_hint(monkeypatch):
    monkeypatch.setattr(peers, "available_peers", lambda: {})
    with pytest.raises(ValueError, match="pip install --no-deps torchao"):
        peers.build_peer_variants(["bf16_generate", "ao_w8a8"], torch.nn.Linear(2, 2))
    assert peers.build_peer_variants(["bf16_generate", "quasar_ngram"], torch.nn.Linear(2, 2)) == {}
    assert peers.report_names(["ao_w8a8", "quasar_ngram"]) == {"ao_w8a8": "ao_w8a8", "quasar_ngram": "quasar_ngram"}


def runs_of(tokens):
    return [{"variant": v, "prompt_index": i, "tokens": t} for v, per_prompt in tokens.items() for i, t in enumerate(per_prompt)]


def test_exactness_compares_each_peer_with_its_plain_greedy_run():
    tokens = {
        "ao_w8a8": [[1, 2, 3], [4]],
        "ao_w8a8_prompt_lookup": [[1, 2, 3], [5]],
        "w8a8_generate": [[9], [8]],
        "quasar_ngram": [[9], [9]],
        "w8a8_compiled": [[9], [6]],
        "quasar_ngram_compiled": [[9], [6]],
        "bf16_prompt_lookup": [[7], [7]],
        "some_other_variant": [[7], [7]],
    }
    summaries = {name: {} for name in tokens}
    peers.mark_peer_exactness(summaries, runs_of(tokens))
    assert summaries["ao_w8a8"]["same_tokens_as_own_plain_greedy"] == 1.0
    assert summaries["ao_w8a8_prompt_lookup"]["same_tokens_as_own_plain_greedy"] == 0.5
    assert summaries["quasar_ngram"]["same_tokens_as_own_plain_greedy"] == 0.5  # vs the W8A8 model's own generate
    assert summaries["quasar_ngram_compiled"]["same_tokens_as_own_plain_greedy"] == 1.0  # vs compiled plain, not eager
    assert summaries["bf16_prompt_lookup"]["same_tokens_as_own_plain_greedy"] is None  # bf16_generate did not run
    assert "same_tokens_as_own_plain_greedy" not in summaries["some_other_variant"]
    alone = {"ao_w8a8_prompt_lookup": {}}
    peers.mark_peer_exactness(alone, runs_of({"ao_w8a8_prompt_lookup": [[1]]}))
    assert alone["ao_w8a8_prompt_lookup"]["same_tokens_as_own_plain_greedy"] is None


def test_torchao_peers_run_on_a_tiny_model(tmp_path):
    pytest.importorskip("torchao", reason="torchao is an optional peer (pip install --no-deps torchao==0.18.0)")
    reference = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "src"), dtype=torch.float32).eval()
    variants = peers.build_peer_variants(list(peers.TORCHAO_PEERS) + ["quasar_ngram"], reference)
    assert set(variants) == set(peers.TORCHAO_PEERS)
    tokens = {name: [generate(PROMPT, 12)[0]] for name, generate in variants.items()}
    assert all(len(t[0]) == 12 for t in tokens.values())
    summaries = {name: {} for name in tokens}
    peers.mark_peer_exactness(summaries, runs_of(tokens))
    assert summaries["ao_w8a8"]["same_tokens_as_own_plain_greedy"] == 1.0  # the other's value is what the bench reports
    names = peers.report_names(["ao_w8a8"])
    assert names["ao_w8a8"].startswith("ao_w8a8 (torchao ")


def test_llamacpp_peers_need_the_package_and_a_gguf(monkeypatch, tmp_path):
    from quasar_hf.bench import llamacpp_peer

    monkeypatch.setattr(llamacpp_peer, "llamacpp_version", lambda: None)
    with pytest.raises(ValueError, match="pip install llama-cpp-python"):
        llamacpp_peer.build_llamacpp_variants(["llamacpp_q8_0"], str(tmp_path / "m.gguf"), {2})
    assert llamacpp_peer.build_llamacpp_variants(["quasar_ngram"], None, {2}) == {}
    monkeypatch.setattr(llamacpp_peer, "llamacpp_version", lambda: "0.0")
    with pytest.raises(ValueError, match="need a GGUF file"):
        llamacpp_peer.build_llamacpp_variants(["llamacpp_q8_0_lookup"], str(tmp_path / "missing.gguf"), {2})


def test_llamacpp_lookup_is_checked_against_plain_llamacpp():
    tokens = {"llamacpp_q8_0": [[1, 2], [3]], "llamacpp_q8_0_lookup": [[1, 2], [4]]}
    summaries = {name: {} for name in tokens}
    peers.mark_peer_exactness(summaries, runs_of(tokens))
    assert summaries["llamacpp_q8_0"]["same_tokens_as_own_plain_greedy"] == 1.0
    assert summaries["llamacpp_q8_0_lookup"]["same_tokens_as_own_plain_greedy"] == 0.5


def test_eos_ids_as_generate_stops():
    model = torch.nn.Linear(2, 2)
    assert peers._eos_ids(model) == set()
    model.generation_config = type("G", (), {"eos_token_id": [7, 9]})()
    assert peers._eos_ids(model) == {7, 9}


def test_compiled_variants_call_generate_with_the_compiled_steps_and_warm_every_prompt(monkeypatch):
    """Compiled variants pass `quasar={"compile": ...}` to generate and warm up on every prompt (each
    prompt's cache size may be a new compiled shape), the others on the first prompt only."""
    from quasar_hf.bench import runner

    calls = []

    class Recorder(torch.nn.Linear):
        def generate(self, input_ids, max_new_tokens, **kwargs):
            calls.append((int(input_ids[0, 0]), kwargs.get("quasar"), kwargs.get("prompt_lookup_num_tokens")))
            return torch.cat([input_ids, input_ids[:, :max_new_tokens]], dim=1)

    model = Recorder(2, 2)
    model.generation_config = type("GenerationConfig", (), {"eos_token_id": 0})()
    prompts = [{"id": f"p{i}", "suite": "s", "version": 1, "messages": [{"role": "user", "content": "x"}]} for i in range(3)]
    monkeypatch.setattr(runner, "render_prompt", lambda item, tok: [int(item["id"][1]) + 1, 7, 7])
    variants = ["w8a8_compiled", "quasar_ngram_compiled", "bf16_prompt_lookup"]
    result = runner.run_bench(model, model, None, prompts=prompts, variants=variants, max_new_tokens=2, repeats=1, warmup=1)
    warm = calls[3 : 3 + 7]  # after the 2-token probes: 3 + 3 compiled warm-ups, 1 plain
    assert sorted(p for p, quasar, _ in warm if quasar == {"compile": True, "num_draft_tokens": 0}) == [1, 2, 3]
    assert sorted(p for p, quasar, _ in warm if quasar == {"compile": True}) == [1, 2, 3]
    assert [p for p, quasar, lookup in warm if lookup] == [1]
    assert result["variants"]["quasar_ngram_compiled"]["same_tokens_as_own_plain_greedy"] == 1.0
