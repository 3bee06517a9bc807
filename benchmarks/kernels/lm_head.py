"""The row-stable lm_head kernel's builds vs BF16 `F.linear`, at real vocabulary shapes, M = 1 and 6.

Every build this CPU runs is timed (on an AVX-512 CPU both the AVX-512 and the AVX2 build), side by
side and interleaved, cycling weight copies that together exceed the last-level cache, so every
call reads its weight from memory as a decode or verify step does. Each build is checked bit for
bit against `rowstable_linear_reference` first. The floor is the weight's bytes at the measured
read bandwidth.

    python -m benchmarks lm-head --baseline BEFORE.c [BEFORE_AVX2.c ...] --name lm_head_kernels_cpu

A baseline is another C source of the same entry point (say a kernel before a change), built for
AVX-512 when it uses AVX-512 intrinsics (and this CPU has them), else for AVX2.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

from benchmarks import reports_dir
from benchmarks.kernels import c_kernels
from benchmarks.kernels.build_reports import check_baselines, selected_shapes, write_build_reports
from benchmarks.kernels.kernels import interleaved_medians, measure_read_bandwidth
from quasar_hf.bench.report import markdown_table
from quasar_hf.ops.reference import rowstable_linear_reference

VARIANTS = [(r.source, r.cflags, r.cpu_flags) for r in c_kernels.kernel_build_table() if r.kernel == "rowstable_linear"]

# (label, vocabulary N, hidden K): the lm_heads of the checkpoints the project runs end to end.
SHAPES = [
    ("SmolLM2-135M", 49152, 576),
    ("Gemma 3 270M", 262144, 640),
    ("Qwen2.5-Coder-0.5B", 151936, 896),
    ("Llama-3.2-1B", 128256, 2048),
]
WORKING_SET = 768 * 2**20  # bytes of weight copies cycled: above the 300 MiB L3 seen on this project's Xeons


def _uses_avx512(path: str) -> bool:
    """True for a C source written with AVX-512 intrinsics (built like the AVX-512 variant)."""
    with open(path) as source:
        return "_mm512" in source.read()


def _builds(baselines: list[str] | None) -> dict[str, object]:
    """name -> entry point of every build this CPU runs (and of each of `baselines`, C sources of the
    same entry point, say the kernels before a change), each checked against the oracle."""
    builds = {}
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 100, generator=gen).bfloat16(), torch.randn(37, 100, generator=gen).bfloat16()
    sources = [(source, flags) for source, flags, required in VARIANTS if not c_kernels.missing_cpu_flags(required)]
    for baseline in baselines or ():
        wide = _uses_avx512(baseline)
        if wide and c_kernels.missing_cpu_flags(VARIANTS[0][2]):
            continue  # an AVX-512 baseline on a CPU without AVX-512
        sources.append((os.path.abspath(baseline), VARIANTS[0][1] if wide else ("-mavx2", "-mfma")))
    for source, flags in sources:
        fn = c_kernels.load_entry(source, "qhf_rowstable_linear", flags)
        if not torch.equal(c_kernels.rowstable_linear(fn, x, w, None), rowstable_linear_reference(x, w)):
            raise AssertionError(f"{source} disagrees with the reference")
        builds[os.path.basename(source).removesuffix(".c") + (" (baseline)" if os.path.isabs(source) else "")] = fn
    return builds


def measure(
    shapes: list[tuple[str, int, int]],
    rows: tuple[int, ...],
    samples: int,
    baselines: list[str] | None = None,
    working_set: int = WORKING_SET,
) -> dict:
    """Median ms per call of each build and of F.linear, per shape and row count."""
    builds = _builds(baselines)
    bandwidth, results = 0.0, []
    for label, n, k in shapes:
        bandwidth = max(bandwidth, measure_read_bandwidth(torch.device("cpu")))  # the best seen: a shared machine drifts
        copies = max(2, math.ceil(working_set / (n * k * 2)))
        weights = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            variants = {
                name: (lambda i, fn=fn, x=x, ws=weights: c_kernels.rowstable_linear(fn, x, ws[i % len(ws)], None))
                for name, fn in builds.items()
            }
            variants["F.linear (torch)"] = lambda i, x=x, ws=weights: F.linear(x, ws[i % len(ws)])
            medians = interleaved_medians(variants, torch.device("cpu"), samples, batch=copies)
            for name, seconds in medians.items():
                results.append(
                    {
                        "shape": label,
                        "N": n,
                        "K": k,
                        "rows": m,
                        "kernel": name,
                        "ms": seconds * 1e3,
                        "gb_s": n * k * 2 / seconds / 1e9,
                    }
                )
        del weights
    for r in results:  # the floor at the best bandwidth of the run
        r["x_floor"] = r["ms"] / (r["N"] * r["K"] * 2 / (bandwidth * 1e9) * 1e3)
    return {"read_bandwidth_gb_s": bandwidth, "torch_threads": torch.get_num_threads(), "results": results}


def to_markdown(result: dict, command: str) -> str:
    lines = ["# Row-stable lm_head kernel builds vs F.linear (bf16)", "", f"Command: `{command}`", ""]
    lines += [
        f"Read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s (the best of one reading per shape); "
        f"{result['torch_threads']} threads. "
        "Floor = the weight's bytes at that bandwidth. F.linear's rounding depends on the row count "
        "(it is not row-stable); it is here as the speed a user gets without our kernel.",
        "",
    ]
    rows = [
        [r["shape"], r["rows"], r["kernel"], f"{r['ms']:.2f}", f"{r['x_floor']:.2f}", f"{r['gb_s']:.1f}"]
        for r in result["results"]
    ]
    lines += markdown_table(["shape", "rows", "kernel", "ms", "x floor", "GB/s"], rows)
    lines += ["", f"Environment: {result['environment']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks lm-head", description=__doc__.split("\n")[0])
    parser.add_argument("--name", default="lm_head_kernels_cpu", help="report name (benchmarks/NAME.md/.json)")
    parser.add_argument("--out", default=reports_dir("lm-head"), help="folder for the reports")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 6], help="query rows per call")
    parser.add_argument("--samples", type=int, default=5, help="interleaved samples per variant")
    parser.add_argument("--shapes", nargs="+", default=None, help="labels of SHAPES to run (default all)")
    parser.add_argument("--baseline", nargs="+", default=None, help="C sources of the same entry point to time beside them")
    args = parser.parse_args(argv)
    shapes = selected_shapes(parser, SHAPES, args.shapes)
    check_baselines(parser, args.baseline)
    result = measure(shapes, tuple(args.rows), args.samples, args.baseline)
    return write_build_reports(result, args.out, args.name, "python -m benchmarks lm-head", argv, to_markdown)
