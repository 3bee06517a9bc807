"""The Hadamard rotation kernel's builds, side by side, at the rotated widths of real models.

A rotated `down_proj` (QuasarConfig's default `rotate`) rotates its input rows, of the MLP's
intermediate width, once per layer and step. Every build of the kernel this CPU runs (csrc/kernel_builds.def)
(and each `--baseline`, a C source of the same entry point, say a build before a change) is checked bit
for bit against the plain-PyTorch oracle (`rotate_rows_reference`) at each shape and
then timed interleaved on decode and verify row counts, each build loaded alone and called directly
(benchmarks/kernels/c_kernels.py: ctypes, into a preallocated output, one thread: what a step's rotation
costs without the op's dispatch); the ctypes call's few microseconds are the same for every build.

    python -m benchmarks hadamard-kernel --baseline BEFORE/hadamard_rows_avx2.c --name hadamard_kernel_cpu
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks import reports_dir
from benchmarks.kernels import c_kernels
from benchmarks.kernels.build_reports import check_baselines, selected_shapes, write_build_reports
from benchmarks.kernels.kernels import interleaved_medians
from quasar_hf.bench.report import markdown_table
from quasar_hf.ops import hadamard_cpu
from quasar_hf.ops.hadamard import HadamardRotation, rotate_rows_reference

# (label, row width): the down_proj input (intermediate size) of the checkpoints the project runs.
SHAPES = [
    ("SmolLM2-135M", 1536),
    ("Gemma 3 270M", 2048),
    ("Qwen2.5-Coder-0.5B", 4864),
    ("Llama-3.2-1B", 8192),
]


def _builds(baselines: list[str] | None) -> dict[str, object]:
    """name (its source) -> entry point of each build this CPU runs, best first, then of each baseline (a C
    source of the same entry point, built with the flags of the build of its file name, or portable flags)."""
    builds = {source: _load(source, flags) for _, source, flags in c_kernels.runnable_builds("hadamard")}
    table = [r for r in c_kernels.kernel_build_table() if r.kernel == "hadamard"]
    for baseline in baselines or ():
        same_name = [r for r in table if r.source == os.path.basename(baseline)]
        flags, required = (same_name[0].cflags, same_name[0].cpu_flags) if same_name else ((), ())
        if c_kernels.missing_cpu_flags(required):
            raise RuntimeError(f"{baseline}: this CPU lacks {required}")
        builds[f"{os.path.basename(baseline)} (baseline)"] = _load(os.path.abspath(baseline), flags)
    return builds


def _load(source: str, flags: tuple[str, ...]) -> object:
    return c_kernels.load_entry(source, "qhf_hadamard_rows", flags)


def _direct_call(fn, inputs: list[torch.Tensor], out: torch.Tensor, rotation: HadamardRotation):
    """call(i): the kernel on inputs[i % len] into `out` (one thread, as a decode or verify step calls it)."""
    signs = hadamard_cpu.signs(rotation)
    return lambda i: c_kernels.hadamard(fn, inputs[i % len(inputs)], rotation, signs, out)


def measure(shapes, rows: tuple[int, ...], samples: int, layers: int, baselines: list[str] | None = None) -> dict:
    """Median microseconds per call of each build, per shape and row count (inputs cycled over `layers` copies)."""
    builds = _builds(baselines)
    fastest = next(iter(builds))  # the build table lists the builds best first
    gen = torch.Generator().manual_seed(0)
    results = []
    for label, width in shapes:
        rotation = HadamardRotation.for_size(width)
        for count in rows:
            inputs = [torch.randn(count, width, generator=gen).bfloat16() for _ in range(layers)]
            expected = rotate_rows_reference(inputs[0], rotation)
            for source, fn in builds.items():
                if not torch.equal(c_kernels.hadamard(fn, inputs[0], rotation, hadamard_cpu.signs(rotation)), expected):
                    raise AssertionError(f"{source} disagrees with rotate_rows_reference at {label} x {count} rows")
            out = torch.empty(count, width)
            variants = {source: _direct_call(fn, inputs, out, rotation) for source, fn in builds.items()}
            medians = interleaved_medians(variants, torch.device("cpu"), samples, batch=layers * 10)
            for source, seconds in medians.items():
                results.append(
                    {
                        "shape": label,
                        "width": width,
                        "rotation": f"{rotation.blocks} x H_{rotation.odd_order} (x) H_{rotation.pow2}",
                        "rows": count,
                        "build": source,
                        "us": seconds * 1e6,
                        "vs_fastest": seconds / medians[fastest],
                    }
                )
    return {"layers": layers, "torch_threads": torch.get_num_threads(), "builds": list(builds), "results": results}


def to_markdown(result: dict, command: str) -> str:
    lines = ["# Hadamard rotation kernel builds (bf16 rows in, fp32 out)", "", f"Command: `{command}`", ""]
    lines += [
        f"Inputs cycled over {result['layers']} copies; every build equal to `rotate_rows_reference` bit for bit "
        "at every shape; median microseconds per call, the kernel called directly (ctypes, one thread, as a step "
        f"calls it). `x {result['builds'][0]}` = time / that build's.",
        "",
    ]
    rows = [
        [r["shape"], r["rotation"], r["rows"], r["build"], f"{r['us']:.1f}", f"{r['vs_fastest']:.2f}"] for r in result["results"]
    ]
    lines += markdown_table(["shape", "rotation", "rows", "build", "us / call", f"x {result['builds'][0]}"], rows)
    lines += ["", f"Environment: {result['environment']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks hadamard-kernel", description=__doc__.split("\n")[0])
    parser.add_argument("--name", default="hadamard_kernel_builds_cpu", help="report name (benchmarks/NAME.md/.json)")
    parser.add_argument("--out", default=reports_dir("hadamard-kernel"), help="folder for the reports")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 6], help="rows per call")
    parser.add_argument("--samples", type=int, default=7, help="interleaved samples per build")
    parser.add_argument("--layers", type=int, default=30, help="input copies cycled")
    parser.add_argument("--shapes", nargs="+", default=None, help="labels of SHAPES to run (default all)")
    parser.add_argument("--baseline", nargs="+", default=None, help="C sources of the same entry point to time beside them")
    args = parser.parse_args(argv)
    shapes = selected_shapes(parser, SHAPES, args.shapes)
    if min(args.rows) < 1 or args.samples < 1 or args.layers < 1:
        parser.error("--rows, --samples and --layers must be positive")
    check_baselines(parser, args.baseline)
    if not hadamard_cpu.is_available():
        parser.error(f"the Hadamard CPU kernel is unavailable here: {hadamard_cpu.unavailable_reason()}")
    result = measure(shapes, tuple(args.rows), args.samples, args.layers, args.baseline)
    return write_build_reports(result, args.out, args.name, "python -m benchmarks hadamard-kernel", argv, to_markdown)
