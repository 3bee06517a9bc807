"""gpu-check's compiled sections: eager vs compiled decode and verify steps over the static KV cache,
against the bytes floor, and compiled `quasar=True` end to end against compiled plain greedy.

On CUDA the steps compile with `compat.default_compile_config` (what `quasar={"compile": True}`
uses: fullgraph, static shapes, CUDA graphs); on CPU (`--tiny`) the same settings give Inductor's
C++ code. The step timings and the end-to-end run share one cache size and the verify keywords,
so they run the same two graphs (decode [1, 1], verify [1, k + 1]) and compile once per model.
"""

from __future__ import annotations

import time

import torch

from quasar_hf.bench.timing import median_time, sync, timed
from quasar_hf.compat import default_compile_config as compile_config
from quasar_hf.ops.rowstable_attention import ROWSTABLE_KWARG
from quasar_hf.speculative import speculative_generate, step_compiler
from quasar_hf.speculative.static_cache import StaticVerifierCache, static_cache_slots

NUM_DRAFT_TOKENS = 5
STEP_TOKENS = (1, NUM_DRAFT_TOKENS + 1)


def sizes(tiny: bool) -> dict:
    """Context of the step timings, prompt and new tokens end to end: all within one cache size."""
    sizes = {"context": 64, "prompt": 128, "new_tokens": 16} if tiny else {"context": 384, "prompt": 256, "new_tokens": 128}
    slots = static_cache_slots(sizes["context"] + NUM_DRAFT_TOKENS + 1)
    assert slots == static_cache_slots(sizes["prompt"] + sizes["new_tokens"] + NUM_DRAFT_TOKENS + 1)
    return {**sizes, "slots": slots}


def kv_bytes(model: torch.nn.Module, tokens: int) -> int:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * tokens * 2  # K and V, bf16


def compiled_steps(model: torch.nn.Module, device: str, tiny: bool, weight_bytes: int, copy_gbps: float) -> list[dict]:
    """Per step shape: eager and compiled ms over the same static cache, the floor, and the first
    compiled call's seconds (compile + CUDA graph capture)."""
    size = sizes(tiny)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, size["context"]), generator=generator).to(device)
    step = step_compiler.compiled_step(model, compile_config(torch.device(device)))
    verify_kwargs = {ROWSTABLE_KWARG: True}  # what the loop passes: the end-to-end run reuses these graphs
    states = {
        "eager": StaticVerifierCache(model, 1, torch.device(device), size["slots"], None, verify_kwargs),
        "compiled": StaticVerifierCache(model, 1, torch.device(device), size["slots"], step, verify_kwargs),
    }
    no_keep = torch.zeros(1, dtype=torch.long, device=device)
    rows = []
    with torch.no_grad():
        for state in states.values():
            state.forward(prompt, last_only=True)
        for tokens in STEP_TOKENS:
            ids = torch.randint(0, vocab, (1, tokens), generator=generator).to(device)

            def run(state: StaticVerifierCache) -> None:
                state.forward(ids)
                state.keep_accepted(no_keep, tokens)  # back to the same cache

            compile_s = timed(lambda: run(states["compiled"]), device)[1]
            iters = 3 if tiny else 20
            eager_s = median_time(lambda: run(states["eager"]), device, iters)
            compiled_s = median_time(lambda: run(states["compiled"]), device, iters, warmup=3)
            floor_s = (weight_bytes + kv_bytes(model, size["context"])) / (copy_gbps * 1e9)
            rows.append(
                {
                    "tokens": tokens,
                    "context": size["context"],
                    "eager_ms": eager_s * 1e3,
                    "compiled_ms": compiled_s * 1e3,
                    "floor_ms": floor_s * 1e3,
                    "compiled_x_floor": compiled_s / floor_s,
                    "first_compiled_call_s": compile_s,
                }
            )
    return rows


def compiled_end_to_end(model: torch.nn.Module, prompt: torch.Tensor, device: str, tiny: bool) -> dict:
    """Compiled plain greedy (the loop with no drafts: every step the compiled decode) and compiled
    `quasar=True` (n-gram drafts): tokens/s of a warm run, and whether their tokens are equal."""
    size = sizes(tiny)
    prompt = prompt[:, : size["prompt"]]
    config = compile_config(torch.device(device))
    out = {}
    tokens = {}
    for name, drafts in (("compiled_plain", 0), ("compiled_quasar_ngram", NUM_DRAFT_TOKENS)):
        quasar = {"drafter": "ngram", "num_draft_tokens": drafts, "compile": config}

        def generate() -> torch.Tensor:
            return speculative_generate(
                model, prompt, torch.ones_like(prompt), quasar_config=quasar, max_new_tokens=size["new_tokens"],
                do_sample=False, return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip

        generate()  # warm: compiles (or reuses) the two graphs
        sync(device)
        start = time.perf_counter()
        result = generate()
        sync(device)
        seconds = time.perf_counter() - start
        tokens[name] = result.sequences
        stats = result.quasar_stats
        new = result.sequences.shape[1] - prompt.shape[1]
        out[name] = {
            "tokens_per_s": new / seconds,
            "new_tokens": new,
            "mean_acceptance_length": stats.mean_acceptance_length if drafts else None,
        }
    out["quasar_equals_plain"] = bool(torch.equal(tokens["compiled_plain"], tokens["compiled_quasar_ngram"]))
    return out


def reset_compiled(model: torch.nn.Module) -> None:
    """Drop the model's compiled callable and Dynamo's caches (before the weights are swapped)."""
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    torch._dynamo.reset()


def markdown(result: dict) -> list[str]:
    """The compiled sections' tables (empty when absent)."""
    from quasar_hf.bench.report import markdown_table

    lines = []
    for key in ("compiled_steps_bf16", "compiled_steps_w8a8"):
        if result.get(key):
            lines += [f"## Static-cache steps, eager vs compiled ({key.rsplit('_', 1)[1].upper()})", ""]
            lines += markdown_table(
                ["tokens", "context", "eager ms", "compiled ms", "floor ms", "compiled x floor", "first compiled call s"],
                [
                    [r["tokens"], r["context"], r["eager_ms"], r["compiled_ms"], r["floor_ms"], r["compiled_x_floor"],
                     r["first_compiled_call_s"]]
                    for r in result[key]
                ],
            ) + [""]  # fmt: skip
    for key in ("compiled_end_to_end_bf16", "compiled_end_to_end_w8a8"):
        e2e = result.get(key)
        if e2e:
            lines += [f"## Compiled end to end ({key.rsplit('_', 1)[1].upper()}, n-gram drafts, random weights)", ""]
            rows = [
                [n, s["tokens_per_s"], s["new_tokens"], s["mean_acceptance_length"]]
                for n, s in e2e.items()
                if n != "quasar_equals_plain"
            ]
            lines += markdown_table(["variant", "tokens/s", "new tokens", "L"], rows)
            lines += ["", f"Compiled quasar=True equals compiled plain greedy: {e2e['quasar_equals_plain']}.", ""]
    return lines


def compiled_targets(result: dict) -> dict:
    """Ratios of the compiled sections (None where missing)."""
    steps_b = {r["tokens"]: r for r in result.get("compiled_steps_bf16") or []}
    steps_q = {r["tokens"]: r for r in result.get("compiled_steps_w8a8") or []}
    verify = STEP_TOKENS[-1]
    e2e_b, e2e_q = result.get("compiled_end_to_end_bf16") or {}, result.get("compiled_end_to_end_w8a8") or {}

    def ratio(a: dict, b: dict, key: str) -> float | None:
        return a[key] / b[key] if a and b else None

    quasar = "compiled_quasar_ngram"
    return {
        "compiled W8A8 verify step x floor": steps_q[verify]["compiled_x_floor"] if verify in steps_q else None,
        "compiled verify step BF16 / W8A8": ratio(steps_b.get(verify, {}), steps_q.get(verify, {}), "compiled_ms"),
        "compiled quasar=True W8A8 / BF16 verification (tokens/s)": ratio(
            e2e_q.get(quasar, {}), e2e_b.get(quasar, {}), "tokens_per_s"
        ),
        "compiled quasar=True equals compiled plain (BF16, W8A8)": (
            e2e_b.get("quasar_equals_plain"),
            e2e_q.get("quasar_equals_plain"),
        ),
    }
