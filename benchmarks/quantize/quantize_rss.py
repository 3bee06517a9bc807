"""Peak RSS and seconds per layer of `quasar-hf quantize` on a random-weight checkpoint of a real shape,
over its first layers only: the per-layer working set repeats after them, so the peak of the first
few layers is the run's (saving, at the end, streams one shard at a time).

    python -m benchmarks quantize-rss --shape qwen2.5-1.5b-shape --layers 4 --name quantize_rss_qwen1.5b_shape

The checkpoint is built in a subprocess (benchmarks/quantize/scaling.py), then `quasar-hf quantize` runs as
a user would (`--dtype bfloat16`, the defaults), its resume state is polled, and it is killed once
`--layers` layers are saved. Peak RSS is the quantize process's own (`ru_maxrss` of the reaped child).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import reports_dir
from benchmarks.quantize.scaling import SHAPES
from quasar_hf.bench.report import environment, markdown_table


def _next_layer(progress: Path) -> int:
    try:
        return json.loads(progress.read_text())["next_layer"]
    except (OSError, ValueError, KeyError):
        return 0


def measure(shape: str, layers: int, workdir: Path, tokenizer: str, timeout_s: float) -> dict:
    """Build the checkpoint, quantize its first `layers` layers, kill the run: seconds, peak RSS, per-layer phases."""
    model, out = workdir / "model", workdir / "out"
    shutil.rmtree(workdir, ignore_errors=True)
    build = [sys.executable, "-m", "benchmarks.quantize.scaling", "--phase", "build", "--shape", shape, "--folder", str(model)]
    built = json.loads(subprocess.run([*build, "--tokenizer", tokenizer], capture_output=True, text=True, check=True).stdout)
    log = (workdir / "quantize.log").open("w")
    cmd = [sys.executable, "-m", "quasar_hf.cli", "quantize", str(model), "--out", str(out), "--dtype", "bfloat16", "--profile"]
    started = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    progress = Path(f"{out}.partial") / "progress.json"
    while _next_layer(progress) < layers and child.poll() is None and time.perf_counter() - started < timeout_s:
        time.sleep(2)
    seconds = time.perf_counter() - started
    done = _next_layer(progress)
    child.send_signal(signal.SIGKILL)
    child.wait()
    log.close()
    if done < layers:
        raise RuntimeError(f"only {done} layers were saved in {seconds:.0f} s; see {workdir / 'quantize.log'}")
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest reaped child: the quantize run
    return {
        "shape": shape,
        "layers_of_model": SHAPES[shape]["num_hidden_layers"],
        "layers_done": done,
        "seconds": round(seconds, 1),
        "seconds_per_layer": round(seconds / done, 1),
        "projected_total_s": round(seconds / done * SHAPES[shape]["num_hidden_layers"]),
        "peak_rss_gib": round(peak_kib / 2**20, 2),
        "build": built,
    }


def to_markdown(result: dict) -> str:
    r = result["result"]
    lines = ["# Peak RSS of `quasar-hf quantize` over the first layers (random weights, defaults)", ""]
    lines += [f"Command: `{result['command']}`", ""]
    rows = [
        [r["shape"], f"{r['layers_done']} of {r['layers_of_model']}", f"{r['seconds']:.1f}", f"{r['seconds_per_layer']:.1f}"]
        + [str(r["projected_total_s"]), f"{r['peak_rss_gib']:.2f}"]
    ]
    lines += markdown_table(["shape", "layers", "seconds", "s / layer", "projected total s", "peak RSS GiB"], rows)
    lines += ["", "The projection multiplies the seconds per layer (load included) by the layer count.", ""]
    lines += [f"Environment: {result['environment']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks quantize-rss", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen2.5-1.5b-shape", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=4, help="layers to quantize before the run is killed")
    parser.add_argument(
        "--workdir", default=None, help="scratch folder, deleted first (default: quasar_quantize_rss in the temp folder)"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded SmolLM2's)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before giving up")
    parser.add_argument("--name", default="quantize_rss", help="report name (NAME.md/.json)")
    parser.add_argument("--out", default=reports_dir("quantize-rss"), help="folder for the reports")
    args = parser.parse_args(argv)
    if not 0 < args.layers <= SHAPES[args.shape]["num_hidden_layers"]:
        parser.error(f"--layers must be between 1 and the shape's {SHAPES[args.shape]['num_hidden_layers']} layers")
    workdir = Path(args.workdir or Path(tempfile.gettempdir()) / "quasar_quantize_rss")
    if args.tokenizer is None:
        from quasar_hf.models import smollm2_135m_instruct

        args.tokenizer = str(smollm2_135m_instruct())
    result = {
        "command": "python -m benchmarks quantize-rss " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(),
        "result": measure(args.shape, args.layers, workdir, args.tokenizer, args.timeout),
    }
    json_path, md_path = Path(args.out) / f"{args.name}.json", Path(args.out) / f"{args.name}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(to_markdown(result))
    return [str(json_path), str(md_path)]
