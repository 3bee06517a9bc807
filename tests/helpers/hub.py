"""Shared helpers for the hub/cli/export tests: a tiny checkpoint with a byte-level tokenizer, and
an in-memory stand-in for the Hugging Face Hub's HTTP API (plugged in through
`huggingface_hub.set_client_factory`, the hook huggingface_hub documents for custom clients)."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALIBRATION_TEXT = ["def add(a, b):\n    return a + b\n" * 8, "The quick brown fox jumps over the lazy dog. " * 8]


def byte_level_tokenizer(chat_template: bool = True):
    """A 259-token byte-level tokenizer (256 bytes + 3 specials), built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_checkpoint(path: Path, chat_template: bool = True, seed: int = 0, initializer_range: float = 0.02) -> Path:
    """Save a random 2-layer Llama (hidden 64, vocab 260) + tokenizer to `path`; a larger `initializer_range` makes
    its greedy text vary more (the default one repeats a token or two)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    tokenizer = byte_level_tokenizer(chat_template)
    from tests.helpers.tiny_models import TINY_SHAPE

    config = LlamaConfig(
        **TINY_SHAPE,
        num_hidden_layers=2,
        vocab_size=len(tokenizer) + 1,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        initializer_range=initializer_range,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def quantize_tiny(path: Path, device_map=None, offload_folder=None, dtype=torch.float32, **overrides):
    """Quantize the tiny checkpoint at `path` with Quasar (small, fast calibration), in `dtype`."""
    from transformers import AutoModelForCausalLM

    import quasar_hf

    options = dict(alpha=0.5, calibration_dataset=CALIBRATION_TEXT, num_calibration_samples=2, calibration_seq_len=32)
    options.update(overrides)
    return AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=quasar_hf.QuasarConfig(**options),
        dtype=dtype,
        device_map=device_map,
        offload_folder=offload_folder,
    ).eval()


class HubStandIn:
    """The few Hub endpoints push_to_hub / from_pretrained use, answered from a dict of repos.

    Implemented: POST /api/repos/create, POST /api/validate-yaml, POST .../preupload/{rev} (every file "regular", so
    contents arrive base64 in the commit), POST .../commit/{rev} (ndjson), GET/HEAD
    /{repo}/resolve/{rev}/{file}, GET /api/models/{repo}[/revision/{rev}] (file listing).
    """

    def __init__(self, user: str = "tester") -> None:
        self.user = user
        self.repos: dict[str, dict[str, bytes]] = {}
        self.requests: list[tuple[str, str]] = []
        self.commits: list[dict] = []
        self.validated: list[str] = []

    def handler(self, request):
        import httpx2

        path = request.url.path
        self.requests.append((request.method, path))
        if path == "/api/repos/create":
            body = json.loads(request.content)
            repo_id = f"{body.get('organization') or self.user}/{body['name']}"
            self.repos.setdefault(repo_id, {})
            url = f"{request.url.scheme}://{request.url.host}/{repo_id}"
            return httpx2.Response(200, json={"url": url, "name": repo_id, "id": repo_id})
        if path == "/api/validate-yaml":
            return self._validate_yaml(json.loads(request.content)["content"])
        if path.startswith("/api/models/") and "/preupload/" in path:
            files = json.loads(request.content)["files"]
            return httpx2.Response(
                200, json={"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
            )
        if path.startswith("/api/models/") and "/commit/" in path:
            repo_id = path[len("/api/models/") :].split("/commit/")[0]
            return self._commit(repo_id, request.content)
        if path.startswith("/api/models/"):
            repo_id = "/".join(path[len("/api/models/") :].split("/")[:2])
            return self._info(repo_id)
        if "/resolve/" in path:
            repo_id, rest = path.lstrip("/").split("/resolve/", 1)
            filename = rest.split("/", 1)[1]
            return self._resolve(request.method, repo_id, filename)
        return httpx2.Response(404, headers={"X-Error-Code": "RepoNotFound"}, json={"error": f"unhandled {path}"})

    def _validate_yaml(self, content: str):
        """Like the Hub: 400 with errors when the README's YAML metadata is malformed."""
        import httpx2
        from huggingface_hub import ModelCard

        try:
            data = ModelCard(content, ignore_metadata_errors=False).data.to_dict()
            problems = [] if isinstance(data.get("tags", []), list) else ["tags must be a list"]
        except Exception as error:  # the stand-in reports any parse failure as the Hub would
            problems = [str(error)]
        self.validated.append(content)
        status = 400 if problems else 200
        return httpx2.Response(status, json={"errors": [{"message": p} for p in problems], "warnings": []})

    def _commit(self, repo_id: str, content: bytes):
        import httpx2

        if repo_id not in self.repos:
            return httpx2.Response(404, headers={"X-Error-Code": "RepoNotFound"}, json={"error": "no repo"})
        lines = [json.loads(line) for line in content.decode().splitlines() if line.strip()]
        files = {}
        for item in lines:
            if item["key"] == "file":
                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
        self.repos[repo_id].update(files)
        self.commits.append({"repo_id": repo_id, "header": lines[0]["value"], "files": sorted(files)})
        oid = hashlib.sha1(json.dumps(self.commits[-1]).encode()).hexdigest()
        self.commits[-1]["oid"] = oid
        return httpx2.Response(200, json={"commitUrl": f"https://huggingface.co/{repo_id}/commit/{oid}", "commitOid": oid})

    def _info(self, repo_id: str):
        import httpx2

        if repo_id not in self.repos:
            return httpx2.Response(404, headers={"X-Error-Code": "RepoNotFound"}, json={"error": "no repo"})
        siblings = [{"rfilename": name} for name in sorted(self.repos[repo_id])]
        return httpx2.Response(200, json={"id": repo_id, "sha": "0" * 40, "siblings": siblings, "private": False})

    def _resolve(self, method: str, repo_id: str, filename: str):
        import httpx2

        files = self.repos.get(repo_id)
        if files is None:
            return httpx2.Response(404, headers={"X-Error-Code": "RepoNotFound"})
        if filename not in files:
            return httpx2.Response(404, headers={"X-Error-Code": "EntryNotFound"})
        data = files[filename]
        headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": "0" * 40, "Content-Length": str(len(data))}
        return httpx2.Response(200, headers=headers, content=b"" if method == "HEAD" else data)


def saved_quasar_tiny(folder: Path, work: Path) -> Path:
    """A saved Quasar checkpoint of the tiny model, with its tokenizer, in `folder` (the float one in `work`)."""
    from transformers import AutoTokenizer

    base = make_tiny_checkpoint(work)
    quantize_tiny(base).save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder
