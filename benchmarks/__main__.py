"""`python -m benchmarks <measurement> [options]`: dispatch to one measurement's own `main(argv)`.

`python -m benchmarks` (or `--help`) lists the measurements; `python -m benchmarks NAME --help`
shows that measurement's options.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module:function taking argv, what it measures)
MEASUREMENTS: dict[str, tuple[str, str]] = {
    "step": ("benchmarks.speed.step:main", "where a decode / verify step's time goes, against its bytes floor"),
    "ab-step": ("benchmarks.speed.ab_step:main", "two source trees' steps alternated batch by batch (a code change as a ratio)"),
    "same-bits": (
        "benchmarks.speed.same_bits:main",
        "two source trees' eager logits and tokens on saved checkpoints, compared bit for bit",
    ),
    "compiled-rows": (
        "benchmarks.speed.compiled_rows:main",
        "compiled verify rows vs compiled decode steps over a static cache, per compile mode",
    ),
    "compiled-steps": (
        "benchmarks.speed.compiled_steps:main",
        "eager vs compiled decode / verify steps against the bytes floor, and end to end with exactness",
    ),
    "compiled-shapes": (
        "benchmarks.speed.compiled_shapes:main",
        "compiled generation over changing batch sizes and lengths: compile cost per new shape, exactness",
    ),
    "graph-ops": ("benchmarks.speed.graph_ops:main", "our ops per decoder layer in a compiled step's graph, per W8A8 backend"),
    "scaling": ("benchmarks.quantize.scaling:main", "quantize cost and step time at real Llama sizes (random weights)"),
    "quantize-rss": (
        "benchmarks.quantize.quantize_rss:main",
        "peak RSS and seconds per layer of `quasar-hf quantize` over a real shape's first layers",
    ),
    "drafters": ("benchmarks.speed.drafters:main", "drafters compared on a real checkpoint, grounded and open prompts"),
    "fidelity": (
        "benchmarks.fidelity.variants:main",
        "W8A8 vs BF16 perplexity, top-1 and KL of QuasarConfig variants on one model",
    ),
    "rotation-sqnr": (
        "benchmarks.fidelity.rotation_sqnr:main",
        "act-only SQNR of down_proj / o_proj inputs: SmoothQuant vs Hadamard rotation",
    ),
    "fidelity-acceptance": (
        "benchmarks.fidelity.fidelity_acceptance:main",
        "W8A8 vs BF16 vs FP32 fidelity plus acceptance length on the embedded model",
    ),
    "kernels": ("benchmarks.kernels.kernels:main", "W8A8 linear vs BF16 micro-benchmark at real model shapes"),
    "attention-kernel": (
        "benchmarks.kernels.attention_kernel:main",
        "the row-stable attention kernel's builds at real models' attention shapes",
    ),
    "prefill-attention": (
        "benchmarks.kernels.prefill_attention:main",
        "a prompt's causal attention: the AVX512-BF16 kernel vs SDPA, alone and in a whole prefill",
    ),
    "turn-prefill": (
        "benchmarks.speed.turn_prefill:main",
        "a chat turn's prefill over its cached history: the mask read per layer vs once per forward (MaskFacts)",
    ),
    "hadamard-kernel": (
        "benchmarks.kernels.hadamard_kernel:main",
        "the Hadamard rotation kernel's builds at real models' rotated widths",
    ),
    "lm-head": (
        "benchmarks.kernels.lm_head:main",
        "the row-stable lm_head kernel's builds vs F.linear at real vocabulary shapes",
    ),
    "per-layer": ("benchmarks.fidelity.per_layer_report:main", "W8A8 error per decoder linear: weight-only, activation-only"),
    "per-layer-compare": (
        "benchmarks.fidelity.per_layer_compare:main",
        "two per-layer reports of one model side by side (dB change)",
    ),
    "humaneval": ("quasar_hf.eval.humaneval:main", "HumanEval pass@1: unquantized vs W8A8 vs W8A8 with Quasar decoding"),
    "export-loaders": (
        "benchmarks.fidelity.export_loaders:main",
        "compressed-tensors exports read by Transformers' loader, against the Quasar model they came from",
    ),
    "gpu-check": ("benchmarks.gpu.gpu_check:main", "one-call GPU check: kernels, verify step, end to end (--tiny on CPU)"),
    "load-checksum": (
        "benchmarks.speed.load_checksum:main",
        "the SHA-256 check at load beside reading the tensors, at real checkpoint sizes",
    ),
    "serve-load": (
        "benchmarks.serve.serve_load:main",
        "quasar-hf serve (Quasar on and off), transformers serve (BF16) and llama-server under 1-8 concurrent clients",
    ),
    "serve-soak": (
        "benchmarks.serve.soak:main",
        "quasar-hf serve under thousands of mixed requests, some clients leaving mid-stream: failures and RSS",
    ),
    "scheduler-profile": (
        "benchmarks.serve.scheduler_profile:main",
        "clients through the serving scheduler in one process, greedy or sampled: step time by rows, prefills",
    ),
    "serve-chat": (
        "benchmarks.serve.chat_turns:main",
        "quasar-hf serve with its prompt cache on and off: a growing conversation, clients behind one system prompt",
    ),
    "serve-shapes": (
        "benchmarks.serve.load_shapes:main",
        "quasar-hf serve (and llama-server) under three load shapes: short among long, steady arrivals, sampled",
    ),
    "admission-mix": (
        "benchmarks.serve.admission_mix:main",
        "the scheduler's admission policies in one process: waves of short and long requests sent at once",
    ),
    "scrape-cost": (
        "benchmarks.serve.scrape_cost:main",
        "quasar-hf serve's CPU per /metrics scrape, and the share of decoding a scrape per second can take",
    ),
    "serve-profile": (
        "benchmarks.serve.serve_profile:main",
        "where one client's time goes: the serve-load prompts offline per mode, prefill / draft / forwards / loop",
    ),
    "vllm-check": (
        "benchmarks.serve.vllm_check:main",
        "serve the compressed-tensors export in vLLM and compare its greedy output",
    ),
}


def usage() -> str:
    width = max(len(name) for name in MEASUREMENTS)
    rows = [f"  {name:<{width}}  {about}" for name, (_, about) in MEASUREMENTS.items()]
    return "usage: python -m benchmarks MEASUREMENT [options]   (MEASUREMENT --help for its options)\n\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in MEASUREMENTS:
        print(f"python -m benchmarks: error: unknown measurement {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, function = MEASUREMENTS[name][0].split(":")
    entry = getattr(importlib.import_module(module_name), function)
    result = entry(rest)
    if isinstance(result, int):  # an exit status
        return result
    if isinstance(result, list):  # the report files it wrote
        print("\n".join(str(path) for path in result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
