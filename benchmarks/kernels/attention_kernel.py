"""The row-stable attention kernel's builds, side by side, at the attention shapes of real models.

Every build this CPU runs (on an AVX-512 CPU both the AVX-512 and the AVX2 build) and each baseline
(a C source of the same entry point, say the kernel before a change, built the same ways) is timed
interleaved on a decode or verify call: Q query rows over a static cache of `--slots` slots of
which `--written` hold keys (each row sees them causally), K/V cycled over `--layers` copies as a
step's layers would be. The current source's builds are checked bit for bit against its portable
build first, baselines against the fp64 oracle (their bits may differ). Each build is loaded alone
(benchmarks/kernels/c_kernels.py); times include the ctypes call from Python (a few microseconds, the same
for every build).

    python -m benchmarks attention-kernel --baseline BEFORE.c --name attention_kernel_cpu
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
from quasar_hf.ops.reference import attention_reference

# (label, query heads, kv heads, head size): the attention of the checkpoints the project runs.
SHAPES = [
    ("SmolLM2-135M", 9, 3, 64),
    ("Qwen2.5-Coder-0.5B", 14, 2, 64),
    ("Llama-3.2-1B", 32, 8, 64),
    ("Gemma 3 270M", 4, 1, 256),
]


def _load(flags: tuple[str, ...], source: str) -> object:
    return c_kernels.load_entry(source, "qhf_rowstable_attention", flags)


def _builds(baselines: list[str] | None) -> dict[str, object]:
    """name -> entry point of each build this CPU runs, of the current source and of each baseline."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, *shape, generator=gen).bfloat16() for shape in ((6, 5, 64), (2, 70, 64), (2, 70, 64)))
    portable = c_kernels.attention(_load((), "rowstable_attention.c"), q, k, v, None)
    reference = attention_reference(q, k, v)
    builds = {}
    for label, source, flags in c_kernels.runnable_builds("attention"):
        if label == "portable":
            continue
        fn = _load(flags, source)
        if not torch.equal(c_kernels.attention(fn, q, k, v, None), portable):
            raise AssertionError(f"the {label} build disagrees with the portable build")
        builds[label] = fn
        for baseline in baselines or ():
            old = _load(flags, os.path.abspath(baseline))  # its includes from csrc/
            err = (c_kernels.attention(old, q, k, v, None).double() - reference).abs()
            if not bool((err <= reference.abs() * 2.0**-8 + 1e-6).all()):
                raise AssertionError(f"{baseline} ({label}) disagrees with the fp64 reference")
            builds[f"{label} {os.path.basename(baseline)} (baseline)"] = old
    return builds


def _call_inputs(heads: int, kv_heads: int, dim: int, q_len: int, slots: int, written: int, layers: int):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads, q_len, dim, generator=gen).bfloat16()
    kv = [
        (
            torch.randn(1, kv_heads, slots, dim, generator=gen).bfloat16(),
            torch.randn(1, kv_heads, slots, dim, generator=gen).bfloat16(),
        )
        for _ in range(layers)
    ]
    visible = torch.zeros(1, q_len, slots, dtype=torch.bool)
    for i in range(q_len):
        visible[0, i, : written - q_len + i + 1] = True
    return q, kv, visible.view(torch.uint8), torch.empty(1, q_len, heads, dim, dtype=torch.bfloat16)


def measure(shapes, rows: tuple[int, ...], samples: int, baselines, slots: int, written: int, layers: int) -> dict:
    """Median microseconds per call of each build, per shape and row count."""
    builds = _builds(baselines)
    results = []
    for label, heads, kv_heads, dim in shapes:
        for q_len in rows:
            q, kv, visible, out = _call_inputs(heads, kv_heads, dim, q_len, slots, written, layers)
            scale = dim**-0.5
            variants = {
                name: (lambda i, fn=fn: c_kernels.attention(fn, q, *kv[i % layers], visible, scale, out))
                for name, fn in builds.items()
            }
            medians = interleaved_medians(variants, torch.device("cpu"), samples, batch=layers * 10)
            for name, seconds in medians.items():  # each build against the current source's of its ISA
                current = medians[name.split()[0]]
                results.append(
                    {"shape": label, "rows": q_len, "kernel": name, "us": seconds * 1e6, "vs_current": seconds / current}
                )
    return {"slots": slots, "written": written, "layers": layers, "torch_threads": torch.get_num_threads(), "results": results}


def to_markdown(result: dict, command: str) -> str:
    lines = ["# Row-stable attention kernel builds (bf16)", "", f"Command: `{command}`", ""]
    lines += [
        f"{result['torch_threads']} threads; a {result['slots']}-slot static cache with {result['written']} keys "
        f"written (each row sees them causally), K/V cycled over {result['layers']} copies; median microseconds "
        "per call, ctypes call included. `x current` = time / the current source's build of the same ISA.",
        "",
    ]
    rows = [[r["shape"], r["rows"], r["kernel"], f"{r['us']:.1f}", f"{r['vs_current']:.2f}"] for r in result["results"]]
    lines += markdown_table(["shape", "query rows", "build", "us / call", "x current"], rows)
    lines += ["", f"Environment: {result['environment']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks attention-kernel", description=__doc__.split("\n")[0])
    parser.add_argument("--name", default="attention_kernel_builds_cpu", help="report name (benchmarks/NAME.md/.json)")
    parser.add_argument("--out", default=reports_dir("attention-kernel"), help="folder for the reports")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 6], help="query rows per call")
    parser.add_argument("--samples", type=int, default=7, help="interleaved samples per build")
    parser.add_argument("--slots", type=int, default=512, help="static cache slots")
    parser.add_argument("--written", type=int, default=306, help="slots holding keys")
    parser.add_argument("--layers", type=int, default=30, help="K/V copies cycled")
    parser.add_argument("--shapes", nargs="+", default=None, help="labels of SHAPES to run (default all)")
    parser.add_argument("--baseline", nargs="+", default=None, help="C sources of the same entry point to time beside them")
    args = parser.parse_args(argv)
    shapes = selected_shapes(parser, SHAPES, args.shapes)
    if not 0 < max(args.rows) <= args.written <= args.slots:
        parser.error("need 0 < --rows <= --written <= --slots")
    check_baselines(parser, args.baseline)
    result = measure(shapes, tuple(args.rows), args.samples, args.baseline, args.slots, args.written, args.layers)
    return write_build_reports(result, args.out, args.name, "python -m benchmarks attention-kernel", argv, to_markdown)
