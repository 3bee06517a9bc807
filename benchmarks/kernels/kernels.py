"""W8A8 linear vs BF16 `F.linear` micro-benchmark, per backend, at real model shapes.

What it measures, for every (shape, M, backend): the median time of one linear call, cycling
through enough weight copies that the weights do not sit in cache (as in decode, where every
layer's weight comes from memory), and the achieved bandwidth
`(weight bytes + activation bytes read) / time`, compared with a measured copy bandwidth
(`dst.copy_(src)` of a large tensor, read + write bytes).

    python -m benchmarks kernels --out benchmarks/ --quick            # this device
    python -m benchmarks kernels --device cuda --out results/ --ms 1 16 64

Python API: `run_kernel_benchmark(device, shapes, ms, backends) -> dict`, then
`write_json(result, path)` / `write_markdown(result, path)`.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import reports_dir
from quasar_hf.bench.report import environment
from quasar_hf.bench.timing import timed
from quasar_hf.ops.dispatch import available_backends, pack_weight_for, w8a8_linear

# (label, in_features K, out_features N): the linears of the models the method targets.
SHAPES: list[tuple[str, int, int]] = [
    ("llama3-8b.qkvo 4096x4096", 4096, 4096),
    ("llama3-8b.gate/up 4096x14336", 4096, 14336),
    ("llama3-8b.down 14336x4096", 14336, 4096),
    ("llama3-8b.kv 4096x1024", 4096, 1024),
    ("qwen3-8b.gate/up 4096x12288", 4096, 12288),
    ("qwen3-8b.down 12288x4096", 12288, 4096),
    ("smollm2-135m.qo 576x576", 576, 576),
    ("smollm2-135m.kv 576x192", 576, 192),
    ("smollm2-135m.gate/up 576x1536", 576, 1536),
    ("smollm2-135m.down 1536x576", 1536, 576),
]
MS: list[int] = [1, 2, 4, 8, 16, 32, 64]
# The reference is an fp64 oracle, far too slow to be worth timing at 8B shapes.
DEFAULT_EXCLUDED = ("reference",)


def _time_batch(fn: Callable[[int], object], device: torch.device, first: int, batch: int) -> float:
    """Mean seconds per call of `fn(first) ... fn(first + batch - 1)` (the index cycles weight copies)."""

    def calls() -> None:
        for i in range(first, first + batch):
            fn(i)

    return timed(calls, device)[1] / batch


def interleaved_medians(
    variants: dict[str, Callable[[int], object]], device: torch.device, samples: int, batch: int
) -> dict[str, float]:
    """Median seconds per call of each variant, timing them round-robin.

    Interleaving puts every variant under the same background load (this matters on a shared
    machine), so their ratios stay meaningful even when absolute times drift.
    """
    for fn in variants.values():
        fn(0)
        fn(1)  # warm-up: lazy builds, Triton compilation, allocator
    times: dict[str, list[float]] = {name: [] for name in variants}
    for sample in range(samples):
        for name, fn in variants.items():
            times[name].append(_time_batch(fn, device, 2 + sample * batch, batch))
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure_copy_bandwidth(device: torch.device, mebibytes: int = 512, samples: int = 5) -> float:
    """GB/s of `dst.copy_(src)` on a large tensor, counting bytes read + written."""
    src = torch.ones(mebibytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    seconds = interleaved_medians({"copy": lambda _: dst.copy_(src)}, device, samples, batch=1)["copy"]
    return 2 * src.numel() * 4 / seconds / 1e9


def measure_read_bandwidth(device: torch.device, mebibytes: int = 512, samples: int = 5) -> float:
    """GB/s of reading a large tensor once (`src.sum()`: bytes read only), the bound a weight-streaming
    step faces. On this CPU it is close to the copy figure (read + write), not half of it."""
    src = torch.ones(mebibytes * 2**20 // 4, device=device)
    seconds = interleaved_medians({"read": lambda _: src.sum()}, device, samples, batch=1)["read"]
    return src.numel() * 4 / seconds / 1e9


def _copies_needed(int8_weight_bytes: int, device: torch.device) -> int:
    """Weight copies to cycle so that even the int8 working set is >= 3x the last-level cache."""
    working_set = 256 * 2**20 if device.type == "cuda" else 96 * 2**20  # H200 L2 ~60 MiB; this CPU's L3 32 MiB
    return max(2, min(1024, math.ceil(working_set / int8_weight_bytes)))


def _random_int8_layer(n: int, k: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(device)
    w_scale = (torch.rand(n, generator=gen) * 1e-3 + 1e-4).to(device)
    return w_q, w_scale


def _bench_shape(
    label: str, k: int, n: int, ms: list[int], backends: list[str], device: torch.device, samples: int
) -> list[dict]:
    """All rows for one weight shape: bf16 baseline then each backend, for every M."""
    gen = torch.Generator().manual_seed(0)
    copies = _copies_needed(n * k, device)
    bf16 = [(torch.randn(n, k, generator=gen) * 0.02).to(device, torch.bfloat16) for _ in range(copies)]
    int8 = [_random_int8_layer(n, k, device, gen) for _ in range(copies)]
    packs = {b: [pack_weight_for(w_q, b) for w_q, _ in int8] for b in backends}
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
        variants = {"bf16": lambda i: F.linear(x, bf16[i % copies])}
        for backend in backends:

            def call(i: int, b: str = backend) -> torch.Tensor:
                w_q, w_scale = int8[i % copies]
                return w8a8_linear(x, w_q, w_scale, backend=b, packed=packs[b][i % copies])

            variants[backend] = call
        medians = interleaved_medians(variants, device, samples, batch=min(copies, 8))
        for name, seconds in medians.items():
            rows.append(_row(label, k, n, m, name, seconds, medians["bf16"], 2 if name == "bf16" else 1))
    return rows


def _row(label: str, k: int, n: int, m: int, backend: str, seconds: float, bf16_seconds: float,
         weight_bytes_per_elem: int) -> dict:  # fmt: skip
    bytes_read = n * k * weight_bytes_per_elem + m * k * 2  # weight + bf16 activations
    return {
        "shape": label, "K": k, "N": n, "M": m, "backend": backend,
        "time_us": seconds * 1e6, "speedup_vs_bf16": bf16_seconds / seconds, "gbps": bytes_read / seconds / 1e9,
    }  # fmt: skip


def run_kernel_benchmark(
    device: str | torch.device | None = None,
    shapes: list[tuple[str, int, int]] | None = None,
    ms: list[int] | None = None,
    backends: list[str] | None = None,
    samples: int = 15,
    copy_mebibytes: int = 512,
) -> dict:
    """Time BF16 F.linear and each W8A8 backend on `device` for every (shape, M).

    shapes: (label, in_features, out_features) triples (default SHAPES); ms: token counts
    (default MS); backends: default every available one except the slow reference;
    samples: timed samples per point (median reported); copy_mebibytes: size of the copy probe.
    Returns {"environment", "copy_gbps", "rows": [...], "summary"}; each row has shape, K, N, M,
    backend, time_us, speedup_vs_bf16, gbps and fraction_of_copy_bw.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = shapes or SHAPES
    ms = ms or MS
    if backends is None:
        backends = [b for b in available_backends(device) if b not in DEFAULT_EXCLUDED]
    copy_gbps = measure_copy_bandwidth(device, copy_mebibytes)
    started = time.time()
    rows = []
    for label, k, n in shapes:
        rows += _bench_shape(label, k, n, ms, backends, device, samples)
    for row in rows:
        row["fraction_of_copy_bw"] = row["gbps"] / copy_gbps
    return {
        "environment": environment(device=device),
        "copy_gbps": copy_gbps,
        "backends": backends,
        "samples": samples,
        "wall_seconds": time.time() - started,
        "rows": rows,
        "summary": summarize(rows),
    }


def summarize(rows: list[dict]) -> dict:
    """Per backend: min / median speedup vs BF16 over M <= 16 at the 8B shapes, and at SmolLM2 shapes."""
    summary = {}
    for backend in sorted({r["backend"] for r in rows} - {"bf16"}):
        for group, prefix in (("8b_shapes", ("llama3", "qwen3")), ("smollm2_shapes", ("smollm2",))):
            speedups = [r["speedup_vs_bf16"] for r in rows
                        if r["backend"] == backend and r["M"] <= 16 and r["shape"].startswith(prefix)]  # fmt: skip
            if speedups:
                summary[f"{backend}.{group}.m_le_16"] = {
                    "min_speedup": min(speedups),
                    "median_speedup": statistics.median(speedups),
                    "n": len(speedups),
                }
    return summary


def write_json(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def to_markdown(result: dict) -> str:
    """One table per shape: rows M, columns time / speedup / GB/s per backend."""
    env = result["environment"]
    lines = [
        f"# W8A8 kernel micro-benchmark ({env['device']})", "",
        f"Command: `{result.get('command', 'run_kernel_benchmark(...)')}`", "",
        f"torch {env['torch']}, {env['cpu_count']} CPUs, {env['torch_threads']} torch threads"
        + (f", GPU {env['gpu']}" if "gpu" in env else "")
        + f"; load average {_fmt_load(env['load_average'])}; measured copy bandwidth {result['copy_gbps']:.1f} GB/s"
        f" (read + write). Median of {result['samples']} samples, variants timed round-robin, weights cycled past the cache.", "",
        "Cells: time in us / speedup vs BF16 F.linear / achieved GB/s (weight + activation bytes read).", "",
    ]  # fmt: skip
    lines += _load_caution(env)
    names = ["bf16", *result["backends"]]
    for label in dict.fromkeys(r["shape"] for r in result["rows"]):
        lines += [f"## {label}", "", "| M | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for m in dict.fromkeys(r["M"] for r in result["rows"] if r["shape"] == label):
            cells = {r["backend"]: r for r in result["rows"] if r["shape"] == label and r["M"] == m}
            lines.append(f"| {m} | " + " | ".join(_cell(cells.get(b)) for b in names) + " |")
        lines.append("")
    lines += ["## Summary (M <= 16)", "", "| backend.shapes | min speedup | median speedup | cases |", "|---|---|---|---|"]
    for key, s in result["summary"].items():
        lines.append(f"| {key} | {s['min_speedup']:.2f}x | {s['median_speedup']:.2f}x | {s['n']} |")
    return "\n".join(lines) + "\n"


def _fmt_load(load: list[float] | None) -> str:
    return "n/a" if not load else " / ".join(f"{v:.1f}" for v in load) + " (1 / 5 / 15 min)"


def _load_caution(env: dict) -> list[str]:
    """A warning paragraph when the machine was busier than its CPU count (shared machine)."""
    load, cpus = env.get("load_average"), env.get("cpu_count") or 1
    if env.get("device", "cpu") != "cpu" or not load or load[0] <= cpus:
        return []
    return [
        f"**Caution:** the 1-minute load average was {load[0]:.1f} on {cpus} CPUs during this run (other jobs "
        "shared the machine): absolute times are inflated and noisy. Variants were timed round-robin, so "
        "the speedup columns compare them under the same load, but single cells can still be outliers.", "",
    ]  # fmt: skip


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    return f"{row['time_us']:.0f} / {row['speedup_vs_bf16']:.2f}x / {row['gbps']:.1f}"


def write_markdown(result: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_markdown(result))
    return path


# ---------------------------------------------------------------- the command
def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    parser.add_argument("--out", default=reports_dir("kernels"), help="directory for kernels_<device>.json and .md")
    parser.add_argument("--quick", action="store_true", help="7 samples per point instead of 15")
    parser.add_argument("--ms", type=int, nargs="+", default=None, help=f"token counts M (default {MS})")
    parser.add_argument("--backends", nargs="+", default=None, help="W8A8 backends (default: all available)")
    parser.add_argument("--shapes", nargs="+", default=None, help="shape label prefixes, e.g. llama3 smollm2")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before timing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [s for s in SHAPES if args.shapes is None or s[0].startswith(tuple(args.shapes))]
    if not shapes:
        raise SystemExit(f"no shape matches {args.shapes}; labels are {[s[0] for s in SHAPES]}")
    result = run_kernel_benchmark(args.device, shapes, args.ms, args.backends, samples=7 if args.quick else 15)
    result["command"] = "python -m benchmarks kernels " + shlex.join(sys.argv[1:] if argv is None else argv)
    device_type = torch.device(result["environment"]["device"]).type
    out = Path(args.out)
    for path in (
        write_json(result, out / f"kernels_{device_type}.json"),
        write_markdown(result, out / f"kernels_{device_type}.md"),
    ):
        print(f"wrote {path}")
    print(to_markdown(result))
    return result


if __name__ == "__main__":
    main()
