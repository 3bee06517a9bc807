"""llama.cpp peers for the benchmark (llama-cpp-python): what most people run on a CPU instead.

  llamacpp_q8_0          the same checkpoint as a Q8_0 GGUF, plain greedy decoding
  llamacpp_q8_0_lookup   the same model with llama-cpp-python's prompt lookup decoding
                         (`LlamaPromptLookupDecoding`: same draft length, n-grams up to 3)

Both need a GGUF of the benchmarked checkpoint (`quasar-hf bench --gguf FILE`). llama.cpp ships
the converter; from a llama.cpp checkout (or the `vendor/llama.cpp` folder of the
llama-cpp-python source distribution):

    PYTHONPATH=llama.cpp/gguf-py python llama.cpp/convert_hf_to_gguf.py CHECKPOINT_DIR \\
        --outtype q8_0 --outfile model-q8_0.gguf

Installing: `pip install llama-cpp-python diskcache` compiles llama.cpp for the local CPU. On a
Xeon with AMX that native build (0.3.36) crashed in `llama_decode` on Q8_0 models; building
without AMX works:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
        -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" pip install llama-cpp-python diskcache

Token ids are the checkpoint's own (the converter keeps the vocabulary), so each variant takes
the same prompt ids as the Transformers variants and its tokens compare one to one. Every call
starts from an empty KV cache: llama-cpp-python would otherwise reuse the cached prefix of the
previous call with the same prompt, which no other variant gets.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Any

import torch

from quasar_hf.bench.variants import Generate

LLAMACPP_PEERS = ("llamacpp_q8_0", "llamacpp_q8_0_lookup")
INSTALL_HELP = (
    "pip install llama-cpp-python  (compiles llama.cpp: tens of minutes on 2 cores) and pass "
    "--gguf FILE: a Q8_0 GGUF of the same checkpoint (see quasar_hf/bench/llamacpp_peer.py for the conversion)"
)
CONTEXT_TOKENS = 4096


def llamacpp_version() -> str | None:
    """llama-cpp-python's version when it imports, else None."""
    try:
        import llama_cpp  # noqa: F401

        return importlib.metadata.version("llama_cpp_python")
    except Exception:  # an installed but broken build is as good as absent here
        return None


def _load(gguf: str, lookup_tokens: int | None) -> Any:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = None if lookup_tokens is None else LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=lookup_tokens)
    return Llama(
        model_path=gguf,
        n_ctx=CONTEXT_TOKENS,
        n_threads=torch.get_num_threads(),
        n_threads_batch=torch.get_num_threads(),
        draft_model=draft,
        seed=0,
        verbose=False,
    )


def _greedy(llm: Any, stop_ids: set[int]) -> Generate:
    """Greedy decoding through `Llama.generate` (temperature 0), stopping after a token of
    `stop_ids` (the Transformers model's eos ids, so every variant stops at the same tokens)."""

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
        if input_ids.shape[0] != 1:
            raise ValueError("the llama.cpp peers decode one prompt at a time")
        llm.reset()  # no KV reuse from the previous call
        out: list[int] = []
        for token in llm.generate(input_ids[0].tolist(), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) >= max_new_tokens or int(token) in stop_ids:
                break
        return out, {}

    return run


def build_llamacpp_variants(
    names: list[str] | tuple[str, ...], gguf: str | None, stop_ids: set[int], num_draft_tokens: int = 5
) -> dict[str, Generate]:
    """Generate functions for the llama.cpp peers among `names` (others ignored); a clear error
    when llama-cpp-python does not import or no GGUF was given."""
    wanted = [name for name in names if name in LLAMACPP_PEERS]
    if not wanted:
        return {}
    if llamacpp_version() is None:
        raise ValueError(f"variants {wanted} need llama-cpp-python, which does not import here: {INSTALL_HELP}")
    if not gguf or not os.path.isfile(gguf):
        raise ValueError(f"variants {wanted} need a GGUF file of the benchmarked checkpoint (got {gguf!r}): {INSTALL_HELP}")
    builders = {
        "llamacpp_q8_0": lambda: _greedy(_load(gguf, None), stop_ids),
        "llamacpp_q8_0_lookup": lambda: _greedy(_load(gguf, num_draft_tokens), stop_ids),
    }
    return {name: builders[name]() for name in wanted}
