"""save_pretrained / push_to_hub of Quasar models: card written, user README kept, upload through
huggingface_hub's own API against an in-memory stand-in of the Hub, and reload."""

from __future__ import annotations

import httpx2
import huggingface_hub
import pytest
import torch
from huggingface_hub.utils._http import default_client_factory
from transformers import AutoModelForCausalLM

from quasar_hf.hub.model_card import FALLBACK_CARD_NAME, is_quasar_card, validate_model_card
from tests.helpers.hub import HubStandIn, make_tiny_checkpoint, quantize_tiny


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    base = make_tiny_checkpoint(tmp_path_factory.mktemp("base"))
    return quantize_tiny(base)


@pytest.fixture()
def hub():
    standin = HubStandIn()
    huggingface_hub.set_client_factory(
        lambda: httpx2.Client(transport=httpx2.MockTransport(standin.handler), follow_redirects=True)
    )
    yield standin
    huggingface_hub.set_client_factory(default_client_factory)


def test_save_pretrained_writes_card_and_reloads_identically(quantized, tmp_path):
    quantized.save_pretrained(tmp_path)
    card = (tmp_path / "README.md").read_text()
    assert is_quasar_card(card)
    validate_model_card(card)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, quantized(ids).logits)


def test_user_readme_is_never_overwritten(quantized, tmp_path):
    (tmp_path / "README.md").write_text("# my notes\n")
    with pytest.warns(UserWarning, match="QUASAR_MODEL_CARD.md"):
        quantized.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "# my notes\n"
    assert is_quasar_card((tmp_path / FALLBACK_CARD_NAME).read_text())


def test_our_own_card_is_refreshed(quantized, tmp_path):
    (tmp_path / "README.md").write_text("<!-- quasar-hf:model-card old -->\nstale\n")
    quantized.save_pretrained(tmp_path)
    assert "stale" not in (tmp_path / "README.md").read_text()
    assert not (tmp_path / FALLBACK_CARD_NAME).exists()


def test_non_quasar_models_are_untouched(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "plain")
    assert not (base / "README.md").exists()


def test_push_to_hub_uploads_weights_config_card_and_reloads(quantized, hub, tmp_path):
    commit = quantized.push_to_hub("quasar-tiny", token="hf_test_token", tags=["tiny"])
    files = hub.repos["tester/quasar-tiny"]
    assert {"README.md", "config.json", "model.safetensors"} <= set(files)
    assert commit.oid == hub.commits[-1]["oid"]
    card = files["README.md"].decode()
    assert is_quasar_card(card) and "tester/quasar-tiny" in card
    assert "tiny" in validate_model_card(card).data.tags
    assert any(path == "/api/validate-yaml" for _, path in hub.requests)  # the Hub-side metadata check ran

    reloaded = AutoModelForCausalLM.from_pretrained(
        "tester/quasar-tiny", token="hf_test_token", cache_dir=tmp_path / "cache", dtype=torch.float32
    ).eval()
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, quantized(ids).logits)


def test_push_keeps_a_remote_readme_we_did_not_write(quantized, hub):
    hub.repos["tester/has-readme"] = {"README.md": b"# hand-written card\n"}
    with pytest.warns(UserWarning, match="QUASAR_MODEL_CARD.md"):
        quantized.push_to_hub("has-readme", token="hf_test_token")
    files = hub.repos["tester/has-readme"]
    assert files["README.md"] == b"# hand-written card\n"
    assert is_quasar_card(files[FALLBACK_CARD_NAME].decode())


def test_push_takes_transformers_arguments_and_rejects_what_it_rejects(quantized, hub):
    with pytest.raises(TypeError):  # Transformers' push_to_hub takes its options as keywords too
        quantized.push_to_hub("x", "a commit message")
    with pytest.raises(TypeError):
        quantized.push_to_hub("x", no_such_option=True)
    quantized.push_to_hub(
        repo_id="all-options",
        commit_message="m",
        commit_description="d",
        private=True,
        token="hf_test_token",
        create_pr=False,
        max_shard_size="1GB",
        tags=["extra-tag"],
    )
    assert is_quasar_card(hub.repos["tester/all-options"]["README.md"].decode())


def test_card_usage_snippet_runs_as_written(quantized, tmp_path):
    """The card's snippet (chat template, generate(quasar=True), decode) executes as written."""
    import re

    from quasar_hf.hub.model_card import model_card_for
    from tests.helpers.hub import byte_level_tokenizer

    quantized.save_pretrained(tmp_path)
    tokenizer = byte_level_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    card = model_card_for(quantized, repo_id=str(tmp_path), tokenizer=tokenizer)
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    exec(compile(snippet, "model-card-snippet", "exec"), {})
