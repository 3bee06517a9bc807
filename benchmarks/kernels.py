"""W8A8 linear vs BF16 micro-benchmark at real model shapes (quasar_hf.bench.kernels), written as JSON + markdown.

python -m benchmarks kernels --out benchmarks/ --quick            # this device
python -m benchmarks kernels --device cuda --out results/ --ms 1 16 64
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from quasar_hf.bench.kernels import MS, SHAPES, run_kernel_benchmark, to_markdown, write_json, write_markdown


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    parser.add_argument("--out", default="benchmarks", help="directory for kernels_<device>.json and .md")
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
