"""`quasar-hf demo`: quantize the embedded SmolLM2-135M-Instruct once (cached), then generate on an
input-grounded prompt with and without Quasar and print both outputs, tokens/s, L and the speedup."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# Spelling correction of a given paragraph: the answer mostly copies the prompt, so n-gram drafts pay,
# and SmolLM2-135M does it well (all three typos fixed; BF16 and W8A8 greedy texts are identical).
DEMO_PROMPT = (
    "Fix the spelling mistakes in this text:\n\n"
    "I beleive the goverment should do more to protect the enviroment. Many people agree, but nothing "
    "has changed yet. Our city could plant more trees, build safer bike lanes and make public transport "
    "cheaper. These changes would make the air cleaner and the streets quieter for everyone."
)
QUANTIZED_NAME = "SmolLM2-135M-Instruct-quasar-w8a8"


def quantize_options() -> dict:
    """QuasarConfig options of the demo checkpoint: the defaults (alpha searched per layer)."""
    return {}


def quantized_demo_checkpoint(log: Any, rebuild: bool = False) -> str:
    """The cached Quasar W8A8 SmolLM2 folder; built on first use (atomically: temp dir, then rename)."""
    from quasar_hf.commands.loading import load_tokenizer, quantize_checkpoint, save_quantized
    from quasar_hf.models import cache_dir, smollm2_135m_instruct

    target = cache_dir() / QUANTIZED_NAME
    if (target / "config.json").is_file() and not rebuild:
        return str(target)
    base = smollm2_135m_instruct()
    log(f"quantizing the embedded SmolLM2-135M-Instruct to W8A8 (once; cached in {target}) ...")
    model = quantize_checkpoint(base, quantize_options(), dtype="bfloat16")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=QUANTIZED_NAME + ".", dir=target.parent))
    save_quantized(model, load_tokenizer(base), str(staging), base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return str(target)


def run_demo(max_new_tokens: int = 128, num_draft_tokens: int = 5, rebuild: bool = False, out: Any = sys.stdout) -> dict:
    """The README's main job; returns the numbers it printed."""
    from quasar_hf.commands.generation import describe, run_generation
    from quasar_hf.commands.loading import encode_prompt, load_model, load_tokenizer
    from quasar_hf.models import smollm2_135m_instruct
    from quasar_hf.speculative import QuasarGenerationConfig

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    quantized_dir = quantized_demo_checkpoint(log, rebuild)
    try:
        verifier = load_model(quantized_dir)
    except (ValueError, OSError, KeyError) as error:  # e.g. a cache written by an older quasar_hf
        log(f"the cached checkpoint does not load ({str(error).splitlines()[0]}); rebuilding it")
        quantized_dir = quantized_demo_checkpoint(log, rebuild=True)
        verifier = load_model(quantized_dir)
    reference = load_model(smollm2_135m_instruct(), dtype="bfloat16")
    tokenizer = load_tokenizer(quantized_dir)
    input_ids = encode_prompt(tokenizer, DEMO_PROMPT)
    quasar = QuasarGenerationConfig(drafter="ngram", num_draft_tokens=num_draft_tokens)
    log("warming up ...")
    run_generation(reference, tokenizer, input_ids, quasar=None, max_new_tokens=4)
    run_generation(verifier, tokenizer, input_ids, quasar=quasar, max_new_tokens=4)
    log(f"generating {max_new_tokens} tokens, greedy ...")
    plain = run_generation(reference, tokenizer, input_ids, quasar=None, max_new_tokens=max_new_tokens)
    fast = run_generation(verifier, tokenizer, input_ids, quasar=quasar, max_new_tokens=max_new_tokens)
    speedup = fast.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else float("nan")
    print(f"Prompt:\n{DEMO_PROMPT}\n", file=out)
    print(f"--- without Quasar (BF16, plain greedy decoding) ---\n{plain.text}\n", file=out)
    print(f"--- with Quasar (W8A8 verifier + n-gram drafts) ---\n{fast.text}\n", file=out)
    print(describe("without Quasar", plain), file=out)
    print(describe("with Quasar   ", fast), file=out)
    print(f"speedup: {speedup:.2f}x", file=out)
    return {
        "tokens_per_s_plain": plain.tokens_per_s,
        "tokens_per_s": fast.tokens_per_s,
        "mean_acceptance_length": fast.mean_acceptance_length,
        "speedup_vs_plain": speedup,
    }
