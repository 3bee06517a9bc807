"""Peer variants for the benchmark: what a Transformers user would run instead of Quasar.

  ao_w8a8                Transformers + torchao W8A8 (`TorchAoConfig(Int8DynamicActivationInt8WeightConfig())`),
                         plain greedy `generate`
  ao_w8a8_prompt_lookup  the same model with Transformers' prompt lookup decoding (same draft length, n-gram <= 3)
  llamacpp_q8_0, llamacpp_q8_0_lookup   llama.cpp on a Q8_0 GGUF, plain and prompt lookup
                         (`quasar_hf.bench.llamacpp_peer`; needs the GGUF file)

Each peer is optional: it exists only when its package imports (`available_peers()` names them
with the package version, for the report), and asking for it without the package raises an
error that says what to install. `build_peer_variants` is the runner's hook: it returns the
generate functions of the peers among the requested names. `mark_peer_exactness` tells, per
variant, how often its greedy tokens equal its own plain greedy tokens (prompt lookup on the torchao
model vs plain generate on the torchao model; Quasar's loop vs plain generate on the W8A8 model).
"""

from __future__ import annotations

import copy
import importlib.metadata
import os

import torch

from quasar_hf.bench.llamacpp_peer import LLAMACPP_PEERS, build_llamacpp_variants, llamacpp_version
from quasar_hf.bench.variants import Generate, greedy_generate

TORCHAO_PEERS = ("ao_w8a8", "ao_w8a8_prompt_lookup")
# peer -> the variant whose greedy tokens it must reproduce (its own plain greedy decoding)
PLAIN_BASELINE = {
    "ao_w8a8": "ao_w8a8",
    "ao_w8a8_prompt_lookup": "ao_w8a8",
    "llamacpp_q8_0": "llamacpp_q8_0",
    "llamacpp_q8_0_lookup": "llamacpp_q8_0",
}


def own_plain_greedy(name: str) -> str | None:
    """The variant whose greedy tokens `name` must reproduce: plain greedy decoding of the same model.

    quasar_* -> w8a8_generate (the W8A8 model's own `generate`), compiled ones -> w8a8_compiled
    (compiled plain greedy: compiled output need not equal eager), bf16 lookup / verify loops ->
    bf16_generate, torchao peers -> ao_w8a8; None for a variant with no such twin.
    """
    if name in PLAIN_BASELINE:
        return PLAIN_BASELINE[name]
    if name.endswith("_compiled"):
        return "w8a8_compiled"
    if name.startswith("quasar_") or name == "w8a8_generate":
        return "w8a8_generate"
    if name.startswith("bf16_"):
        return "bf16_generate"
    return None


INSTALL_HELP = {"torchao": "pip install --no-deps torchao==0.18.0  (next to torch 2.13; --no-deps keeps your torch)"}


def _version(package: str) -> str | None:
    """The installed version when the package imports, else None."""
    try:
        __import__(package)
        return importlib.metadata.version(package)
    except Exception:  # an installed but broken package is as good as absent here
        return None


def available_peers() -> dict[str, str]:
    """Peer variant name -> "package version" for every peer whose package imports here."""
    peers = {}
    version = _version("torchao")
    if version:
        peers.update({name: f"torchao {version}" for name in TORCHAO_PEERS})
    version = llamacpp_version()
    if version:
        peers.update({name: f"llama-cpp-python {version}" for name in LLAMACPP_PEERS})
    return peers


def torchao_w8a8_model(reference_model: torch.nn.Module) -> torch.nn.Module:
    """The reference model quantized by torchao's Int8DynamicActivationInt8WeightConfig.

    Loaded with `from_pretrained(..., quantization_config=TorchAoConfig(...))` when the model came
    from a local folder (what a user writes); otherwise a copy is quantized with `quantize_`, which
    is what TorchAoConfig runs after loading.
    """
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    path = getattr(reference_model, "name_or_path", "") or ""
    if os.path.isdir(path):
        from transformers import AutoModelForCausalLM, TorchAoConfig

        config = TorchAoConfig(Int8DynamicActivationInt8WeightConfig())
        dtype = next(reference_model.parameters()).dtype
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=dtype).eval()
    model = copy.deepcopy(reference_model).eval()
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    return model


def build_peer_variants(
    names: tuple[str, ...] | list[str], reference_model: torch.nn.Module, num_draft_tokens: int = 5, gguf: str | None = None
) -> dict[str, Generate]:
    """Runner hook: generate functions for the peer variants among `names` (other names are ignored).

    The torchao model is quantized once and shared by both torchao peers; the llama.cpp peers load
    `gguf`. A peer whose package does not import raises a ValueError saying what to install.
    """
    variants = build_llamacpp_variants(names, gguf, _eos_ids(reference_model), num_draft_tokens)
    wanted = [name for name in names if name in TORCHAO_PEERS]
    if not wanted:
        return variants
    missing = [name for name in wanted if name not in available_peers()]
    if missing:
        raise ValueError(f"variants {missing} need torchao, which does not import here: {INSTALL_HELP['torchao']}")
    model = torchao_w8a8_model(reference_model)
    builders = {
        "ao_w8a8": lambda: greedy_generate(model),
        "ao_w8a8_prompt_lookup": lambda: greedy_generate(
            model, prompt_lookup_num_tokens=num_draft_tokens, max_matching_ngram_size=3
        ),
    }
    return variants | {name: builders[name]() for name in wanted}


def _eos_ids(model: torch.nn.Module) -> set[int]:
    """The ids plain `generate` stops at (generation_config.eos_token_id: an int or a list)."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(i) for i in eos}


def mark_peer_exactness(summaries: dict[str, dict], runs: list[dict]) -> None:
    """Set summaries[name]["same_tokens_as_own_plain_greedy"] for every variant with a plain twin
    (`own_plain_greedy`): the fraction of its runs whose tokens equal the twin's tokens on the same
    prompt (runs: {variant, prompt_index, tokens}, as the runner records them); None when the twin
    did not run. "runs_equal_to_own_plain_greedy" holds the count behind it: [equal, compared]."""
    for name in summaries:
        baseline = own_plain_greedy(name)
        if baseline is None:
            continue
        plain = {r["prompt_index"]: r["tokens"] for r in runs if r["variant"] == baseline}
        mine = [r for r in runs if r["variant"] == name]
        same = [r["tokens"] == plain[r["prompt_index"]] for r in mine if r["prompt_index"] in plain]
        summaries[name]["same_tokens_as_own_plain_greedy"] = sum(same) / len(same) if same else None
        summaries[name]["runs_equal_to_own_plain_greedy"] = [sum(same), len(same)]


def report_names(names: list[str]) -> dict[str, str]:
    """Variant -> its name in reports, with the peer package version ("ao_w8a8 (torchao 0.18.0)")."""
    versions = available_peers()
    return {name: f"{name} ({versions[name]})" if name in versions else name for name in names}
