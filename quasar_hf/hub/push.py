"""Push a Quasar model to the Hugging Face Hub with its model card.

Uses only huggingface_hub's public API (HfApi.create_repo, hf_hub_download, upload_folder), so
tests can point it at a local stand-in with `huggingface_hub.set_client_factory`.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

from quasar_hf.detect import is_quasar_model
from quasar_hf.hub.model_card import FALLBACK_CARD_NAME, README_NAME, is_quasar_card, model_card_for


def remote_readme(api: Any, repo_id: str, revision: str | None, cache_dir: str) -> str | None:
    """The README.md already in the repo (None when there is none)."""
    from huggingface_hub.errors import EntryNotFoundError, RevisionNotFoundError

    try:
        path = api.hf_hub_download(repo_id, README_NAME, revision=revision, cache_dir=cache_dir)
    except (EntryNotFoundError, RevisionNotFoundError):
        return None
    return Path(path).read_text(encoding="utf-8", errors="replace")


def push_quasar_model(
    model: Any,
    repo_id: str,
    *,
    tokenizer: Any = None,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str = "50GB",
    tags: list[str] | str | None = None,
    base_model: str | None = None,
) -> Any:
    """Upload weights, config, card (and the tokenizer when given) in one commit; returns CommitInfo.

    A README.md already in the repo that quasar_hf did not write is kept: our card is then
    uploaded as QUASAR_MODEL_CARD.md, with a warning.
    """
    from huggingface_hub import HfApi

    if not is_quasar_model(model):
        raise ValueError("push_quasar_model expects a Quasar model; use model.push_to_hub for other models")
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    extra_tags = tuple([tags] if isinstance(tags, str) else (tags or ()))
    with tempfile.TemporaryDirectory() as work_dir, tempfile.TemporaryDirectory() as cache_dir:
        model.save_pretrained(work_dir, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(work_dir)
        card = model_card_for(model, repo_id=repo_id, base_model=base_model, tokenizer=tokenizer)
        if extra_tags:
            card = _with_tags(card, extra_tags)
        existing = remote_readme(api, repo_id, revision, cache_dir)
        card_name = README_NAME
        if existing is not None and not is_quasar_card(existing):
            card_name = FALLBACK_CARD_NAME
            warnings.warn(
                f"{repo_id} already has a README.md that quasar_hf did not write; kept it and uploaded the "
                f"Quasar card as {FALLBACK_CARD_NAME}",
                UserWarning,
                stacklevel=2,
            )
            (Path(work_dir) / README_NAME).unlink(missing_ok=True)
        (Path(work_dir) / card_name).write_text(card, encoding="utf-8")
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=work_dir,
            commit_message=commit_message or "Upload Quasar W8A8 model",
            commit_description=commit_description,
            revision=revision,
            create_pr=create_pr,
        )


def _with_tags(card_text: str, tags: tuple[str, ...]) -> str:
    """Add user tags to the card's metadata."""
    from huggingface_hub import ModelCard

    card = ModelCard(card_text)
    card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *tags]))
    return str(card)
