"""One-shot GPU check (H200): kernels, verify-step latency and end-to-end speed, within a time budget.

    python -m benchmarks gpu-check --out DIR            # on the GPU, < 10 minutes
    python -m benchmarks gpu-check --out DIR --tiny     # same code paths, tiny shapes, CPU, < 3 minutes

Sections (each in its own try/except: a failure is recorded and the next section still runs;
results are rewritten to DIR/gpu_check.json and .md after every section):
  environment   versions, device, threads
  user_path     what a user does first: quantize through from_pretrained(quantization_config=QuasarConfig())
                on the device, save, reload (same logits), generate(quasar=True) vs plain greedy, eager and
                compiled, batch 1 and a left-padded batch of 2 (gpu_user_path.py)
  bandwidth     measured device copy bandwidth (the floor's denominator)
  correctness   every available W8A8 backend vs ops.reference at decode / verify / prefill shapes
  kernels       W8A8 linear vs BF16 linear (cuBLAS), per backend, M in 1..64, 8B shapes, GB/s
                (`benchmarks.kernels.kernels.run_kernel_benchmark`, the ops helper's micro-benchmark)
  verify        verify-step latency of a random Qwen3-8B-shaped model, BF16 vs W8A8 (fused as loads do), 1..8 drafts
  profile_*     one eager 6-token verify step under torch.profiler: device kernels (per decoder layer),
                their summed time, launch calls, host wall time, host us per quasar:: op call (gpu_profile.py)
  end_to_end    tokens/s with n-gram drafts: BF16 generate, BF16-verify loop, Quasar (W8A8) loop
  compiled_*    static-cache decode/verify steps eager vs compiled (CUDA graphs) against the floor,
                and compiled quasar=True vs compiled plain greedy, BF16 and W8A8 (gpu_compiled.py)
  targets       the H200 acceptance targets, checked against the numbers above (report, not assert)
Optional packages (bitsandbytes, datasets, gguf, optimum) are never required here. Errors are recorded
with their full tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu import gpu_compiled
from benchmarks.gpu.gpu_profile import profile_step
from benchmarks.gpu.gpu_report import check_targets, to_markdown
from benchmarks.gpu.gpu_user_path import user_path
from quasar_hf.bench.timing import median_time, sync
from quasar_hf.nn.weight_bytes import step_read_bytes

TINY_SHAPES = [("tiny.up 128x256", 128, 256), ("tiny.down 256x128", 256, 128)]  # (label, K, N) as benchmarks.kernels.kernels
QWEN3_8B = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=4096,
)
QWEN3_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
)


class Budget:
    """A global wall-clock budget; sections ask how much is left before starting costly work."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


# ---------------------------------------------------------------- sections: bandwidth, correctness, kernels
def measure_copy_bandwidth(device: str, tiny: bool) -> dict:
    """Device copy bandwidth in GB/s (bytes read + written), as `benchmarks.kernels.kernels` measures it."""
    from benchmarks.kernels.kernels import measure_copy_bandwidth as copy_gbps

    mebibytes = 64 if tiny else 2048
    return {"mebibytes": mebibytes, "gbps": copy_gbps(torch.device(device), mebibytes, samples=5 if tiny else 20)}


def _quantized_weight(n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    from quasar_hf.ops.reference import quantize_weight_per_channel

    w = torch.randn(n, k, device=device) * 0.02
    return quantize_weight_per_channel(w)


def check_correctness(device: str, tiny: bool, backends: list[str]) -> list[dict]:
    """Each backend vs the reference: max |diff| / max |ref| at decode (M=1), verify (M=6), prefill (M=512/64)."""
    from quasar_hf.ops.dispatch import w8a8_linear
    from quasar_hf.ops.reference import w8a8_linear_reference

    n, k = (256, 128) if tiny else (4096, 4096)
    wq, ws = _quantized_weight(n, k, device)
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    rows = []
    for phase, m in (("decode", 1), ("verify", 6), ("prefill", 64 if tiny else 512)):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        ref = w8a8_linear_reference(x, wq, ws, bias).float()
        for backend in backends:
            try:
                out = w8a8_linear(x, wq, ws, bias=bias, backend=backend).float()
                rel = float((out - ref).abs().max() / ref.abs().max())
                rows.append(
                    {
                        "phase": phase,
                        "M": m,
                        "N": n,
                        "K": k,
                        "backend": backend,
                        "max_rel_err": rel,
                        "bit_exact_fraction": float((out == ref).float().mean()),
                        "ok": rel < 2e-2,
                    }
                )
            except Exception as err:  # one backend failing must not hide the others
                rows.append({"phase": phase, "M": m, "backend": backend, "error": f"{type(err).__name__}: {err}"})
    return rows


def bench_kernels(device: str, tiny: bool, backends: list[str], copy_gbps: float, budget: Budget) -> list[dict]:
    """`benchmarks.kernels.kernels.run_kernel_benchmark` shape by shape (so the budget is checked between shapes)."""
    from benchmarks.kernels.kernels import SHAPES, run_kernel_benchmark

    rows: list[dict] = []
    for shape in TINY_SHAPES if tiny else SHAPES:
        if budget.left() < 45:
            rows.append({"shape": shape[0], "skipped": "time budget"})
            continue
        part = run_kernel_benchmark(
            device,
            [shape],
            [1, 4, 16] if tiny else [1, 2, 4, 8, 16, 32, 64],
            backends,
            samples=3 if tiny else 15,
            copy_mebibytes=16,
        )
        for row in part["rows"]:
            row["fraction_of_copy_bw"] = row["gbps"] / copy_gbps
        rows += part["rows"]
    return rows


# ---------------------------------------------------------------- sections: model-level
def build_model(device: str, tiny: bool) -> torch.nn.Module:
    """A randomly initialised Qwen3 model (8B dims, or tiny) in bf16 on `device`; no download."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**(QWEN3_TINY if tiny else QWEN3_8B), eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    from quasar_hf.hf.quantize_on_load import use_rowstable_lm_head, use_rowstable_norms
    from quasar_hf.ops.rowstable_attention import use_rowstable_attention

    use_rowstable_attention(model)  # what Quasar models run: exact verification without row-by-row calls
    use_rowstable_norms(model)  # and, compiled, every norm and the lm_head as ops of ours
    use_rowstable_lm_head(model)
    return model.eval()


def quantize_in_place(model: torch.nn.Module, backend: str) -> dict:
    """Every decoder nn.Linear a W8A8Linear (lm_head stays bf16), then fused as loads do (hf/fusion.py): counts."""
    from quasar_hf.hf.fusion import fuse_projections
    from quasar_hf.nn import W8A8Linear

    layers = model.model.layers
    names = [n for n, mod in layers.named_modules() if isinstance(mod, torch.nn.Linear)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = layers.get_submodule(parent) if parent else layers
        setattr(owner, child, W8A8Linear.from_linear(getattr(owner, child), backend=backend))
    fused = fuse_projections(model)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "projections": len(names),
        "fused_groups": fused,
        "w8a8_modules": sum(isinstance(m, W8A8Linear) for m in model.modules()),
    }


def _describe(model: torch.nn.Module) -> dict:
    """What the timing sections ran on: config dims and bytes read per forward."""
    c = model.config
    return {
        "layers": c.num_hidden_layers,
        "hidden": c.hidden_size,
        "intermediate": c.intermediate_size,
        "vocab": c.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "bytes_read_per_step_bf16": step_read_bytes(model),
    }


def verify_latency(model: torch.nn.Module, device: str, tiny: bool, copy_gbps: float, budget: Budget) -> list[dict]:
    """Latency of one verify step (1 + k tokens over a cached context), k = 1..8, and its bytes/bandwidth floor."""
    from quasar_hf.bench.fidelity import cached_forward

    context = 64 if tiny else 1024
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, context + 9), device=device)
    _, cache = cached_forward(model, ids[:, :context], None)
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * context * 2
    floor_s = (step_read_bytes(model) + kv_bytes) / (copy_gbps * 1e9)
    rows = []
    for k in range(1, 9):
        if budget.left() < 20:
            rows.append({"draft_tokens": k, "skipped": "time budget"})
            break
        block = ids[:, context : context + k + 1]

        def step() -> None:
            nonlocal cache
            _, cache = cached_forward(model, block, cache)
            cache.crop(-(k + 1))

        seconds = median_time(step, device, iters=3 if tiny else 15)
        rows.append(
            {
                "draft_tokens": k,
                "tokens_per_step": k + 1,
                "ms": seconds * 1e3,
                "floor_ms": floor_s * 1e3,
                "fraction_of_floor": floor_s / seconds,
            }
        )
    return rows


def ngram_prompt(vocab: int, device: str, tiny: bool) -> torch.Tensor:
    """A prompt with repeated segments so that n-gram drafts find matches: [1, T]."""
    g = torch.Generator().manual_seed(1)
    segment = torch.randint(0, vocab, (32 if tiny else 64,), generator=g)
    return torch.cat([segment] * 4)[None].to(device)


def end_to_end(model: torch.nn.Module, variants: list[str], device: str, tiny: bool) -> dict:
    """tokens/s (median of repeats) and L for the given variants on one n-gram-friendly prompt."""
    from quasar_hf.bench.fidelity import aggregate_stats, speculative_tokens
    from quasar_hf.bench.variants import greedy_generate

    prompt = ngram_prompt(model.config.vocab_size, device, tiny)
    max_new = 16 if tiny else 128
    out = {}
    for name in variants:
        runs = []
        for _ in range(2 if tiny else 3):
            sync(device)
            start = time.perf_counter()
            if name == "bf16_generate":
                tokens, stats = greedy_generate(model)(prompt, max_new)
            else:
                tokens, stats = speculative_tokens(model, prompt, max_new, "ngram", 5)
            sync(device)
            runs.append((len(tokens) / (time.perf_counter() - start), stats))
        out[name] = {
            "tokens_per_s_median": statistics.median(r for r, _ in runs),
            **{
                k: v
                for k, v in aggregate_stats([s for _, s in runs]).items()
                if k in ("mean_acceptance_length", "time_per_verify_step_s", "acceptance_rate")
            },
        }
    return out


# ---------------------------------------------------------------- orchestration
def _save(result: dict, out_dir: str) -> None:
    """Rewrite gpu_check.json and gpu_check.md (called after every section)."""
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(to_markdown(result))


def _section(result: dict, out_dir: str, name: str, fn: Callable[[], Any], budget: Budget, min_s: float) -> Any:
    """Run one section into result[name]; record errors/skips instead of raising; save after."""
    if budget.left() < min_s:
        result.setdefault("skipped", {})[name] = f"time budget ({budget.left():.0f} s left, needs ~{min_s:.0f} s)"
        _save(result, out_dir)
        return None
    start = time.monotonic()
    try:
        result[name] = fn()
    except Exception:
        result.setdefault("errors", {})[name] = traceback.format_exc()
    result.setdefault("section_s", {})[name] = time.monotonic() - start
    _save(result, out_dir)
    return result.get(name)


def compiled_sections(result: dict, out_dir: str, model, label: str, device: str, tiny: bool, copy_gbps: float, budget) -> None:
    """compiled_steps_<label> and compiled_end_to_end_<label> (one compile of two graphs), then a reset."""
    prompt = ngram_prompt(model.config.vocab_size, device, tiny)
    steps = lambda: gpu_compiled.compiled_steps(model, device, tiny, step_read_bytes(model), copy_gbps)  # noqa: E731
    _section(result, out_dir, f"compiled_steps_{label}", steps, budget, 60)
    e2e = lambda: gpu_compiled.compiled_end_to_end(model, prompt, device, tiny)  # noqa: E731
    _section(result, out_dir, f"compiled_end_to_end_{label}", e2e, budget, 30)
    gpu_compiled.reset_compiled(model)


def run_gpu_check(
    out_dir: str,
    tiny: bool = False,
    budget_s: float = 540.0,
    backend: str = "auto",
    command: str = "",
    tokenizer: str | None = None,
) -> dict:
    """Run every section within `budget_s` seconds; write DIR/gpu_check.{json,md}; return the result."""
    from benchmarks.speed.attention_check import attention_check
    from quasar_hf.bench.report import environment
    from quasar_hf.ops.dispatch import available_backends

    os.makedirs(out_dir, exist_ok=True)
    device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    if not tiny and device == "cpu":
        raise RuntimeError("no CUDA device: run with --tiny for the CPU check, or on a GPU machine")
    budget = Budget(budget_s)
    started = time.monotonic()
    result: dict = {"command": command, "tiny": tiny, "device": device, "budget_s": budget_s}
    _section(result, out_dir, "environment", environment, budget, 0)
    user = _section(result, out_dir, "user_path", lambda: user_path(device, tiny, tokenizer), budget, 60)
    if user is not None and user.get("errors"):
        result.setdefault("errors", {}).update({f"user_path.{k}": v for k, v in user["errors"].items()})
    backends = [b for b in available_backends(device) if b != "reference" or tiny]
    result["backends"] = backends
    bw = _section(result, out_dir, "bandwidth", lambda: measure_copy_bandwidth(device, tiny), budget, 5)
    copy_gbps = bw["gbps"] if bw else float("nan")
    _section(result, out_dir, "correctness", lambda: check_correctness(device, tiny, backends), budget, 10)
    _section(result, out_dir, "attention", lambda: attention_check(device, tiny, median_time), budget, 20)
    timed = [b for b in backends if b != "reference"]
    _section(result, out_dir, "kernels", lambda: bench_kernels(device, tiny, timed, copy_gbps, budget), budget, 60)
    holder: dict = {}
    _section(result, out_dir, "model", lambda: _describe(holder.setdefault("model", build_model(device, tiny))), budget, 60)
    model = holder.pop("model", None)
    if model is not None:
        _section(result, out_dir, "verify_bf16", lambda: verify_latency(model, device, tiny, copy_gbps, budget), budget, 30)
        _section(result, out_dir, "profile_bf16", lambda: profile_step(model, device, tiny), budget, 10)
        e2e = _section(
            result,
            out_dir,
            "end_to_end",
            lambda: end_to_end(model, ["bf16_generate", "bf16_verify_ngram"], device, tiny),
            budget,
            60,
        )
        compiled_sections(result, out_dir, model, "bf16", device, tiny, copy_gbps, budget)
        if _section(result, out_dir, "quantized_linears", lambda: quantize_in_place(model, backend), budget, 20):
            result["model"]["bytes_read_per_step_w8a8"] = step_read_bytes(model)
            _section(result, out_dir, "verify_w8a8", lambda: verify_latency(model, device, tiny, copy_gbps, budget), budget, 30)
            _section(result, out_dir, "profile_w8a8", lambda: profile_step(model, device, tiny), budget, 10)
            quasar = _section(
                result, out_dir, "end_to_end_w8a8", lambda: end_to_end(model, ["quasar_ngram"], device, tiny), budget, 30
            )
            if e2e is not None and quasar is not None:
                result["end_to_end"] = {**e2e, **quasar}
                del result["end_to_end_w8a8"]
            compiled_sections(result, out_dir, model, "w8a8", device, tiny, copy_gbps, budget)
        del model
    result["targets"] = check_targets(result)
    result["wall_s"] = time.monotonic() - started
    _save(result, out_dir)
    return result


def main(argv: list[str] | None = None) -> int:
    """CLI: python -m benchmarks gpu-check --out DIR [--tiny] [--budget-s 540] [--backend auto]."""
    import shlex
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks gpu-check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (a test of the code paths)")
    parser.add_argument("--budget-s", type=float, default=None, help="global time budget (default 540, tiny 180)")
    parser.add_argument("--backend", default="auto", help="W8A8 backend of the quantized model (default auto)")
    parser.add_argument("--tokenizer", help="tokenizer folder for the user-path section (default: the embedded SmolLM2's)")
    args = parser.parse_args(argv)
    budget = args.budget_s if args.budget_s is not None else (180.0 if args.tiny else 540.0)
    command = "python -m benchmarks gpu-check " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    result = run_gpu_check(args.out, args.tiny, budget, args.backend, command, args.tokenizer)
    print(to_markdown(result))
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
