"""Bandwidth each decode-step matmul reaches, per model shape: W8A8 linears (shared q/k/v and gate/up
calls as the model runs them) and the BF16 lm_head, at 1 and 6 tokens, against the read bandwidth.

Finds which part of a verify step sits far from the bytes floor for a given shape (e.g. why one
shape's step is further from its floor than its neighbours'). Every decoder layer gets its own
weights and one timed pass walks all of them, as a step does, so the weights stream from memory
rather than from cache. Random weights: bytes and time only.

    python scripts/linear_shapes_bandwidth.py [--shapes llama-3.2-1b,llama-3.2-3b,llama-3.1-8b] [--out benchmarks/...json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from quasar_hf.bench.kernels import measure_read_bandwidth
from quasar_hf.nn import W8A8Linear
from quasar_hf.ops.dispatch import bind_folded_group

# (hidden, intermediate, attention heads, kv heads, head dim, vocab, layers) of the real configs
SHAPES = {
    "smollm2-135m": (576, 1536, 9, 3, 64, 49152, 30),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256, 16),
    "llama-3.2-3b": (3072, 8192, 24, 8, 128, 128256, 28),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, 128256, 32),
}


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _group(out_features: list[int], in_features: int, generator: torch.Generator) -> tuple[list[W8A8Linear], object]:
    """Sibling W8A8Linears with random int8 weights (no float copy is ever made), and what runs them:
    one folded-norm group call for several (as q/k/v and gate/up run in a Quasar model), else the linear."""
    modules = []
    for n in out_features:
        q = torch.randint(-127, 128, (n, in_features), generator=generator, dtype=torch.int8)
        shape_only = torch.zeros(1, dtype=torch.bfloat16).expand(n, in_features)  # from_weight reads its shape
        modules.append(W8A8Linear.from_weight(shape_only, rounded=(q, torch.full((n,), 1e-3))))
    if len(modules) == 1:
        return modules, modules[0]
    group = bind_folded_group([m.prepared for m in modules], torch.ones(in_features), 1e-6)
    return modules, group


@torch.no_grad()
def measure_shape(name: str, tokens: int, iters: int, max_layers: int | None = None) -> dict:
    """ms per layer and GB/s of each part over a pass through every layer's own weights, and of lm_head."""
    hidden, inter, heads, kv_heads, head_dim, vocab, layers = SHAPES[name]
    layers = min(layers, max_layers or layers)
    g = torch.Generator().manual_seed(0)
    parts = {
        "qkv": ([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], hidden),
        "o": ([hidden], heads * head_dim),
        "gate_up": ([inter, inter], hidden),
        "down": ([hidden], inter),
    }
    rows = {}
    for label, (outs, k) in parts.items():
        stack = [_group(outs, k, g) for _ in range(layers)]
        x = torch.randn(1, tokens, k, generator=g).to(torch.bfloat16)

        def walk(stack=stack, x=x):
            return [run(x) for _, run in stack]

        ms = _median_ms(walk, iters) / layers
        nbytes = sum(m.weight.numel() for m in stack[0][0])
        rows[label] = {"ms": ms, "bytes": nbytes, "gbps": nbytes / ms / 1e6, "layers": layers}
        del stack
    lm_head = torch.randint(-100, 100, (vocab, hidden), generator=g, dtype=torch.int16).to(torch.bfloat16)
    x = torch.randn(1, tokens, hidden, generator=g).to(torch.bfloat16)
    ms = _median_ms(lambda: F.linear(x, lm_head), iters)
    rows["lm_head_bf16"] = {"ms": ms, "bytes": lm_head.numel() * 2, "gbps": lm_head.numel() * 2 / ms / 1e6, "layers": 1}
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3.2-3b,llama-3.1-8b")
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--max-layers", type=int, default=None, help="fewer layers than the real config (tests)")
    parser.add_argument("--out", default="benchmarks/linear_shapes_bandwidth_cpu.json")
    args = parser.parse_args(argv)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    from quasar_hf.bench.report import environment

    read_gbps = measure_read_bandwidth(torch.device("cpu"))
    result = {
        "command": "python scripts/linear_shapes_bandwidth.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(),
        "read_gbps": read_gbps,
        "shapes": {n: {str(t): measure_shape(n, t, args.iters, args.max_layers) for t in (1, 6)} for n in names},
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    with open(args.out.removesuffix(".json") + ".md", "w") as fh:
        fh.write(to_markdown(result))
    print(to_markdown(result))
    return result


def to_markdown(result: dict) -> str:
    from quasar_hf.bench.report import title_and_command

    lines = title_and_command("Bandwidth of each decode-step matmul by model shape (CPU)", result["command"])
    lines += [f"Read bandwidth measured in the run: {result['read_gbps']:.1f} GB/s. Medians; random weights.", ""]
    lines += ["W8A8 parts: ms per layer, from one pass over every layer's own weights (MB: one layer's int8 weights).", ""]
    lines += ["| shape | tokens | part | MB | ms | GB/s | share of read bandwidth |", "|---|---|---|---|---|---|---|"]
    for name, by_tokens in result["shapes"].items():
        for tokens, parts in by_tokens.items():
            for part, r in parts.items():
                lines.append(
                    f"| {name} | {tokens} | {part} | {r['bytes'] / 1e6:.1f} | {r['ms']:.3f} | {r['gbps']:.1f} | "
                    f"{r['gbps'] / result['read_gbps']:.2f} |"
                )
    env = result["environment"]
    lines += [
        "",
        "Environment: "
        + json.dumps({k: env.get(k) for k in ("cpu", "cpu_count", "torch_threads", "load_average", "git_commit")}),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
