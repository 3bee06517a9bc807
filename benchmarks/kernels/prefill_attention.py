"""A prompt's causal attention: the prompt kernel against torch's SDPA, side by side, with accuracy.

Part 1, the attention alone, at the attention shapes of real models and prompt lengths (`--history H`: each
prompt a chat turn over H cached keys, queries the last of H + L positions): median ms per
call of SDPA (bf16, causal, GQA; what Quasar models ran before the kernel and run where it does not)
and of `quasar::prefill_attention` (the build this CPU runs: AVX512-BF16, AVX-512F or AVX2;
`QUASAR_HF_CPU_FLAGS_OFF=avx512_bf16` or `=avx512_bf16,avx512f` picks a lesser one), interleaved, on inputs laid out as Transformers passes them; beside
each, its error against the fp64 oracle (max abs and RMS).
Part 2 (`--checkpoint`), a whole prefill: one forward of a prompt through a Quasar checkpoint, with the
attention Quasar models load with (the kernel) and with `set_attn_implementation("sdpa")`, interleaved;
beside it, each one's last-token logits against those of the same forward with the prompt's attention
computed by the fp64 oracle (largest difference, and whether the argmax agrees).

    python -m benchmarks prefill-attention --checkpoint CK --name prefill_attention_smollm2_zen4
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from benchmarks import reports_dir
from benchmarks.kernels.attention_kernel import SHAPES
from benchmarks.kernels.build_reports import selected_shapes, write_build_reports
from benchmarks.kernels.kernels import interleaved_medians
from quasar_hf import compat
from quasar_hf.bench.report import markdown_table
from quasar_hf.ops import attention_cpu, native
from quasar_hf.ops.c_build import MASK_ENV
from quasar_hf.ops.reference import attention_reference

CPU = torch.device("cpu")
# what changes which code either side runs: our build's choice, torch's kernels and oneDNN's instruction sets
OVERRIDES = (MASK_ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
ORACLE_ATTENTION = "quasar_bench_fp64_prompt"  # the prompt's attention in fp64, rounded to the model's dtype


def prompt_inputs(heads: int, kv_heads: int, dim: int, length: int, seed: int = 0, history: int = 0):
    """q [1, H, L, D], k/v [1, KVH, history + L, D] bf16, transposed out of [1, T, heads, D] as Transformers lays
    them out."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, length, heads, dim, generator=gen).bfloat16().transpose(1, 2)
    k, v = (torch.randn(1, history + length, kv_heads, dim, generator=gen).bfloat16().transpose(1, 2) for _ in range(2))
    return q, k, v


def causal_pairs(length: int, history: int = 0) -> int:
    """Query-key pairs a causal prompt of `length` tokens over `history` cached ones computes (row i sees
    history + i + 1 keys)."""
    return length * history + length * (length + 1) // 2


def _sdpa(q, k, v, scale):
    if q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)
    length, keys = q.shape[2], k.shape[2]  # SDPA's is_causal is top-left aligned: give the bottom-right mask
    visible = torch.ones(length, keys, dtype=torch.bool).tril(keys - length)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=True).transpose(1, 2)


def gemm_ceiling(samples: int, size: int = 1024) -> dict[str, float]:
    """GFLOP/s of torch's square matmul (oneDNN) in bf16 and fp32 on this CPU and thread count, its fastest of
    `samples` calls: the rate the best-tuned kernel here reaches, a ceiling for attention, which does the same
    multiply-adds plus a softmax."""
    rates = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = (torch.randn(size, size).to(dtype) for _ in range(2))
        a @ b  # warm-up
        fastest = float("inf")
        for _ in range(max(samples, 5)):
            started = time.perf_counter()
            a @ b
            fastest = min(fastest, time.perf_counter() - started)
        rates[name] = 2 * size**3 / fastest / 1e9
    return rates


def _errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out.double() - ref
    return {"max_abs": diff.abs().max().item(), "rms": diff.pow(2).mean().sqrt().item()}


def measure_kernel(shapes, lengths: tuple[int, ...], samples: int, oracle_max: int, history: int = 0) -> list[dict]:
    """Per shape and length (over `history` cached keys): ms per call and GFLOP/s of both, errors against the
    oracle (up to `oracle_max` keys)."""
    rows = []
    for label, heads, kv_heads, dim in shapes:
        for length in lengths:
            q, k, v = prompt_inputs(heads, kv_heads, dim, length, history=history)
            scale = dim**-0.5
            variants = {
                "sdpa": lambda _i: _sdpa(q, k, v, scale),
                "kernel": lambda _i: attention_cpu.prefill_attention(q, k, v, scale),
            }
            medians = interleaved_medians(variants, CPU, samples, batch=1)
            flops = 2 * 2 * heads * dim * causal_pairs(length, history)  # q.k and p.v over the visible pairs
            row = {"shape": label, "length": length, "history": history, "flops": flops}
            for name, seconds in medians.items():
                row[f"{name}_ms"] = seconds * 1e3
                row[f"{name}_gflops"] = flops / seconds / 1e9
            row["speedup"] = medians["sdpa"] / medians["kernel"]
            if history + length <= oracle_max:
                ref = attention_reference(q, k, v, None, scale)
                row["sdpa_error"] = _errors(_sdpa(q, k, v, scale), ref)
                row["kernel_error"] = _errors(attention_cpu.prefill_attention(q, k, v, scale), ref)
            rows.append(row)
    return rows


def _oracle_prompt_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """A prompt's causal attention (no mask, as many keys as queries) by the fp64 oracle; anything else SDPA."""
    if attention_mask is None and query.shape[2] == key.shape[2]:
        return attention_reference(query, key, value, None, scaling).to(query.dtype), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def measure_prefill(checkpoint: str, lengths: tuple[int, ...], samples: int, prompts: int) -> list[dict]:
    """Per prompt length: one forward of the checkpoint with its own attention and with SDPA, interleaved; then,
    over `prompts` prompts, each one's last-token logits against the forward whose prompt attention is the
    fp64 oracle (mean and largest absolute difference, argmax agreements)."""
    from transformers import AutoModelForCausalLM

    compat.register_attention_function(ORACLE_ATTENTION, _oracle_prompt_attention)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    quasar_attention = model.config._attn_implementation
    vocab = model.config.vocab_size

    def forward(ids, implementation):
        model.set_attn_implementation(implementation)
        with torch.inference_mode():
            return model(ids, logits_to_keep=1).logits[0, -1].float()

    rows = []
    for length in lengths:
        inputs = [
            torch.randint(vocab // 8, vocab - vocab // 8, (1, length), generator=torch.Generator().manual_seed(length + seed))
            for seed in range(prompts)
        ]
        medians = interleaved_medians(
            {"sdpa": lambda _i: forward(inputs[0], "sdpa"), "kernel": lambda _i: forward(inputs[0], quasar_attention)},
            CPU,
            samples,
            batch=1,
        )
        row = {"length": length, "prompts": prompts, "sdpa_s": medians["sdpa"], "kernel_s": medians["kernel"]}
        row["speedup"] = medians["sdpa"] / medians["kernel"]
        diffs = {"kernel": [], "sdpa": []}
        for ids in inputs:
            oracle = forward(ids, ORACLE_ATTENTION)
            for name, implementation in (("kernel", quasar_attention), ("sdpa", "sdpa")):
                logits = forward(ids, implementation)
                diffs[name].append(((logits - oracle).abs(), bool(logits.argmax() == oracle.argmax())))
        for name, found in diffs.items():
            row[f"{name}_mean_logit_diff"] = sum(d.mean().item() for d, _ in found) / prompts
            row[f"{name}_max_logit_diff"] = max(d.max().item() for d, _ in found)
            row[f"{name}_same_argmax"] = sum(same for _, same in found)
        rows.append(row)
    model.set_attn_implementation(quasar_attention)
    return rows


def _logits_cell(row: dict, name: str) -> str:
    mean, largest, agree = (row[f"{name}_{key}"] for key in ("mean_logit_diff", "max_logit_diff", "same_argmax"))
    return f"{mean:.3f} / {largest:.3f}, {agree}/{row['prompts']}"


def _error_cell(row: dict, name: str) -> str:
    error = row.get(f"{name}_error")
    return "-" if error is None else f"{error['max_abs']:.4f} / {error['rms']:.2e}"


def to_markdown(result: dict, command: str) -> str:
    build = result.get("build", "avx512bf16")
    lines = [f"# Prefill attention: the prompt kernel ({build} build) against SDPA", "", f"Command: `{command}`", ""]
    if result.get("overrides"):
        lines += ["Environment set: " + ", ".join(f"`{k}={v}`" for k, v in result["overrides"].items()), ""]
    lines += [
        f"{result['torch_threads']} threads, bf16, causal, one prompt; median of {result['samples']} interleaved "
        "calls. Error: max abs / RMS against the fp64 oracle.",
        "",
    ]
    ceiling = result.get("gemm_gflops")
    if ceiling:
        lines += [
            f"Ceiling: torch's {ceiling['size']}-square matmul (fastest call) runs {ceiling['bf16']:.0f} GFLOP/s in bf16 and "
            f"{ceiling['fp32']:.0f} in fp32 here; this build multiplies in {ceiling['kernel_dtype']}, so the kernel's "
            f"GFLOP/s over {ceiling[ceiling['kernel_dtype']]:.0f} is the share of that rate it reaches (last column).",
            "",
        ]
    table = [
        [
            r["shape"], r["length"], f"{r['sdpa_ms']:.2f}", f"{r['kernel_ms']:.2f}", f"{r['speedup']:.2f}x",
            f"{r['sdpa_gflops']:.0f} / {r['kernel_gflops']:.0f}", _error_cell(r, "sdpa"), _error_cell(r, "kernel"),
            f"{r['kernel_gflops'] / ceiling[ceiling['kernel_dtype']]:.2f}" if ceiling else "-",
        ]
        for r in result["kernel"]
    ]  # fmt: skip
    if result.get("history"):
        lines += [
            f"Each prompt is a chat turn over {result['history']} cached keys (SDPA with the bottom-right causal mask).",
            "",
        ]
    headers = [
        "shape", "prompt", "SDPA ms", "kernel ms", "speed-up", "GFLOP/s SDPA / kernel", "SDPA error", "kernel error",
        "kernel / matmul rate",
    ]  # fmt: skip
    lines += markdown_table(headers, table)
    if result.get("prefill"):
        lines += ["", f"## Whole prefill: `{result['checkpoint']}`", ""]
        lines += [
            "One forward of a random-token prompt (logits of its last token), Quasar's attention (the kernel) against "
            "SDPA. Then, over several such prompts, each one's logits against the same forward with the prompt's "
            "attention computed by the fp64 oracle: mean / largest absolute difference, and how many argmaxes agree.",
            "",
        ]
        table = [
            [r["length"], f"{r['sdpa_s']:.3f}", f"{r['kernel_s']:.3f}", f"{r['speedup']:.2f}x", _logits_cell(r, "sdpa"), _logits_cell(r, "kernel")]
            for r in result["prefill"]
        ]  # fmt: skip
        headers = ["prompt", "SDPA s", "kernel s", "speed-up", "SDPA vs oracle: mean / max, argmax", "kernel vs oracle"]
        lines += markdown_table(headers, table)
    lines += ["", f"Environment: {result['environment']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks prefill-attention", description=__doc__.split("\n")[0])
    parser.add_argument("--name", default="prefill_attention_cpu", help="report name (OUT/NAME.md/.json)")
    parser.add_argument("--out", default=reports_dir("prefill-attention"), help="folder for the reports")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1000, 2000], help="prompt lengths")
    parser.add_argument("--samples", type=int, default=5, help="interleaved samples per variant")
    parser.add_argument("--shapes", nargs="+", default=None, help="labels of SHAPES to run (default all)")
    parser.add_argument("--history", type=int, default=0, help="cached keys each prompt follows (a chat turn)")
    parser.add_argument("--oracle-max", type=int, default=2000, help="most keys checked against the fp64 oracle")
    parser.add_argument("--checkpoint", default=None, help="a Quasar checkpoint: also time its whole prefill")
    parser.add_argument("--accuracy-prompts", type=int, default=4, help="prompts per length for the logits' accuracy")
    args = parser.parse_args(argv)
    shapes = selected_shapes(parser, SHAPES, args.shapes)
    if min(args.lengths) < 1 or args.samples < 1 or args.accuracy_prompts < 1:
        parser.error("--lengths, --samples and --accuracy-prompts must be at least 1")
    if args.history < 0 or (args.history and args.checkpoint):
        parser.error("--history must be >= 0, and times the attention alone (leave out --checkpoint)")
    reason = attention_cpu.prefill_unavailable_reason()
    if reason is not None:
        parser.error(f"the prefill attention kernel does not run here: {reason}")
    result = {"torch_threads": torch.get_num_threads(), "samples": args.samples, "checkpoint": args.checkpoint}
    result["history"] = args.history
    result["build"] = native.kernel_builds()["prefill_attention"][0]
    result["overrides"] = {name: os.environ[name] for name in OVERRIDES if name in os.environ}
    result["gemm_gflops"] = {**gemm_ceiling(args.samples), "size": 1024}
    result["gemm_gflops"]["kernel_dtype"] = "bf16" if result["build"] == "avx512bf16" else "fp32"
    result["kernel"] = measure_kernel(shapes, tuple(args.lengths), args.samples, args.oracle_max, args.history)
    if args.checkpoint:
        result["prefill"] = measure_prefill(args.checkpoint, tuple(args.lengths), args.samples, args.accuracy_prompts)
    return write_build_reports(result, args.out, args.name, "python -m benchmarks prefill-attention", argv, to_markdown)
