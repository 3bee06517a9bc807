"""Quantization cost and verify-step time at real Llama sizes, on random-weight checkpoints.

    python -m benchmarks scaling --shapes llama-3.2-1b,llama-3.2-3b,llama-3.1-8b --out benchmarks/reports/scaling/scaling_cpu.json

For each shape (the real configs of Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B, written below as
data): builds a BF16 safetensors checkpoint with random weights one shard at a time (never two
float copies; weights change neither memory nor time), then in a fresh process loads it with
`QuasarConfig()` defaults (quantize-on-load: 32 x 512 calibration tokens, alpha="auto") and records
wall time, peak RSS, the BF16 and W8A8 checkpoint sizes, and the time of a forward of 1 and of 6
tokens over a 300-token cache, with all threads and with one, against the bytes floor (int8
weights + lm_head bytes / read bandwidth, measured in the same process by reading a 512 MiB
tensor once). The calibration tokenizer is a stand-in (SmolLM2's by
default): token ids only need to be valid. Each phase runs in its own process so peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from quasar_hf.bench.report import environment

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_ROPE_CTX = {"original_max_position_embeddings": 8192}
_LLAMA3 = {
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

# config.json values of the real checkpoints (meta-llama/Llama-3.2-1B, -3.2-3B, -3.1-8B).
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_parameters": {**_LLAMA3_ROPE, **_LLAMA3_ROPE_CTX, "factor": 32.0},
    },
    "llama-3.2-3b": {
        **_LLAMA3,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "rope_parameters": {**_LLAMA3_ROPE, **_LLAMA3_ROPE_CTX, "factor": 32.0},
    },
    "llama-3.1-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_parameters": {**_LLAMA3_ROPE, **_LLAMA3_ROPE_CTX, "factor": 8.0},
    },
    # The 1.5B class in Llama layout: Qwen2.5-1.5B's sizes (config.json of Qwen/Qwen2.5-1.5B), without
    # its q/k/v biases (a few KB): the same bytes, FLOPs and per-layer working set.
    "qwen2.5-1.5b-shape": {
        **_LLAMA3,
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    # For the script's own test: same structure, seconds to run.
    "tiny": {
        "vocab_size": 128,
        "max_position_embeddings": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
SHARD_BYTES = 2 * 2**30
CACHE_TOKENS = 300


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def build_checkpoint(shape: str, folder: Path, tokenizer: str, seed: int = 0) -> dict:
    """Write a random-weight BF16 checkpoint of `shape` to `folder`, one shard in memory at a time."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    config = LlamaConfig(**SHAPES[shape], dtype="bfloat16", architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    shapes = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    weight_map, total, shard_bytes = {}, 0, 0

    def flush() -> None:
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shards[-1], str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shards[-1], name))
        shards[-1] = {}

    for name, size in shapes.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(size, dtype=torch.bfloat16)
        else:
            tensor = torch.randn(size, generator=generator, dtype=torch.bfloat16).mul_(0.02)
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + nbytes > SHARD_BYTES:
            flush()
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += nbytes
        total += nbytes
    flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
    return {"bf16_bytes": total, "build_seconds": round(time.perf_counter() - started, 1), "build_peak_rss_mib": peak_rss_mib()}


BANDWIDTH_MIB = 512  # buffer for the bandwidth measurements: far above the last-level cache


@torch.no_grad()
def measure(folder: Path, steps: int, num_calibration_samples: int | None = None, rounding: str | None = None) -> dict:
    """Quantize-on-load with QuasarConfig() defaults, then time 1- and 6-token forwards over a cache."""
    from transformers import AutoModelForCausalLM

    from benchmarks.kernels.kernels import measure_copy_bandwidth, measure_read_bandwidth
    from benchmarks.quantize.quantize_floor import floor_of_quantized
    from quasar_hf import QuasarConfig
    from quasar_hf.nn import W8A8Linear
    from quasar_hf.ops import native
    from quasar_hf.speculative.row_aligned_cache import RowAlignedCache

    native.is_available()  # build or load the C kernels first: a first build is not part of the quantize time
    overrides = {"num_calibration_samples": num_calibration_samples} if num_calibration_samples else {}
    if rounding:
        overrides["weight_rounding"] = rounding
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=QuasarConfig(**overrides))
    load_quantize = time.perf_counter() - started
    info = model.config.quantization_config.calibration_info
    result = {
        "load_and_quantize_seconds": round(load_quantize, 1),
        "quantize_seconds": info["seconds"],
        "math_dtype": info.get("math_dtype"),
        "phase_s": info.get("timing", {}).get("total_s"),
        "floor": floor_of_quantized(model),
        "quantize_peak_rss_mib": peak_rss_mib(),
        "weight_rounding": model.config.quantization_config.weight_rounding,
        "w8a8_state_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
    }
    int8_bytes = sum(m.weight.numel() for m in model.modules() if isinstance(m, W8A8Linear))
    lm_head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    copy_gbps = measure_copy_bandwidth(torch.device("cpu"), BANDWIDTH_MIB)
    read_gbps = measure_read_bandwidth(torch.device("cpu"), BANDWIDTH_MIB)
    floor_ms = (int8_bytes + lm_head_bytes) / (read_gbps * 1e9) * 1e3
    state = RowAlignedCache(model, 1, torch.device("cpu"))
    state.forward(torch.randint(0, model.config.vocab_size, (1, CACHE_TOKENS)))
    threads = torch.get_num_threads()
    for count in sorted({threads, 1}, reverse=True):  # thread scaling: all threads, then one
        torch.set_num_threads(count)
        suffix = "" if count == threads else f"_{count}_thread"
        for tokens in (1, 6):
            state.forward(torch.randint(0, model.config.vocab_size, (1, tokens)))  # warm-up
            state.keep_accepted(torch.tensor([0]), tokens)
            start = time.perf_counter()
            for _ in range(steps):
                state.forward(torch.randint(0, model.config.vocab_size, (1, tokens)))
                state.keep_accepted(torch.tensor([0]), tokens)  # back to the same cache length
            step_ms = (time.perf_counter() - start) / steps * 1e3
            result[f"step_{tokens}_ms{suffix}"] = round(step_ms, 2)
            result[f"step_{tokens}_x_floor{suffix}"] = round(step_ms / floor_ms, 2)
    torch.set_num_threads(threads)
    result.update(
        int8_weight_bytes=int8_bytes,
        lm_head_bytes=lm_head_bytes,
        copy_gbps_read_plus_write=round(copy_gbps, 1),
        read_gbps=round(read_gbps, 1),
        floor_ms=round(floor_ms, 4),
        torch_threads=threads,
    )
    return result


def _in_subprocess(phase: str, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.quantize.scaling", "--phase", phase, *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_shape(
    shape: str,
    workdir: Path,
    tokenizer: str,
    steps: int,
    samples: int | None,
    in_process: bool,
    keep: bool,
    rounding: str | None = None,
) -> dict:
    folder = workdir / shape
    if in_process:
        row = build_checkpoint(shape, folder, tokenizer)
        row.update(measure(folder, steps, samples, rounding))
    else:
        row = _in_subprocess("build", ["--shape", shape, "--folder", str(folder), "--tokenizer", tokenizer])
        row.update(
            _in_subprocess(
                "measure",
                ["--folder", str(folder), "--steps", str(steps)]
                + (["--samples", str(samples)] if samples else [])
                + (["--rounding", rounding] if rounding else []),
            )
        )
    row["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    if not keep:
        shutil.rmtree(folder)
    return row


def to_markdown(report: dict) -> str:
    from benchmarks.quantize.quantize_floor import FLOOR_HEADING, rates_cell

    lines = [
        "# Scaling run: random-weight Llama checkpoints, QuasarConfig() (weight_rounding as shown), CPU",
        "",
        f"Command: `{report['command']}`",
        "",
        "| shape | rounding | BF16 ckpt GB | W8A8 ckpt GB | load + quantize s | quantize s | peak RSS GiB | read GB/s "
        "| floor ms | 1 tok ms (x floor) | 6 tok ms (x floor) | 1 tok ms, 1 thread | 6 tok ms, 1 thread |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for shape, r in report["results"].items():
        lines.append(
            f"| {shape} | {r.get('weight_rounding', '-')} | {r['bf16_bytes'] / 1e9:.2f} | {r['w8a8_state_bytes'] / 1e9:.2f} | "
            f"{r['load_and_quantize_seconds']} | {r['quantize_seconds']} | {r['quantize_peak_rss_mib'] / 1024:.2f} | "
            f"{r.get('read_gbps', '-')} | {r['floor_ms']} | {r['step_1_ms']} ({r['step_1_x_floor']}) | "
            f"{r['step_6_ms']} ({r['step_6_x_floor']}) | {r.get('step_1_ms_1_thread', '-')} | {r.get('step_6_ms_1_thread', '-')} |"
        )
    timed = {shape: r for shape, r in report["results"].items() if r.get("floor")}
    if timed:
        lines += [
            "",
            FLOOR_HEADING,
            "",
            "| shape | calibration math | quantize s | floor s | x floor | GEMM GFLOPS (fp32 / math) | largest phases (s) |",
            "|---|---|---|---|---|---|---|",
        ]
        for shape, r in timed.items():
            floor, phases = r["floor"], sorted((r.get("phase_s") or {}).items(), key=lambda kv: -kv[1])[:4]
            lines.append(
                f"| {shape} | {r.get('math_dtype', '-')} | {r['quantize_seconds']} | {floor['floor_s']} | "
                f"{r['quantize_seconds'] / floor['floor_s'] if floor['floor_s'] else float('inf'):.2f} | {rates_cell(floor)} | "
                + ", ".join(f"{name} {seconds:.1f}" for name, seconds in phases)
                + " |"
            )
    env = report["environment"]
    lines += ["", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="llama-3.2-1b,llama-3.2-3b,llama-3.1-8b")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "quasar_scaling"))
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for calibration (default: SmolLM2's)")
    parser.add_argument("--steps", type=int, default=10, help="timed forwards per token count")
    parser.add_argument("--samples", type=int, default=None, help="override num_calibration_samples (tests only)")
    parser.add_argument("--rounding", choices=["nearest", "gptq"], default=None, help="override weight_rounding")
    parser.add_argument("--in-process", action="store_true", help="no subprocesses (tests; peak RSS then covers all)")
    parser.add_argument("--keep", action="store_true", help="keep the built checkpoints")
    parser.add_argument("--out", default="benchmarks/reports/scaling/scaling_cpu.json")
    parser.add_argument("--phase", choices=["build", "measure"], help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase == "build":
        print(json.dumps(build_checkpoint(args.shape, Path(args.folder), args.tokenizer)))
        return None
    if args.phase == "measure":
        print(json.dumps(measure(Path(args.folder), args.steps, args.samples, args.rounding)))
        return None
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    if args.tokenizer is None:
        from quasar_hf.models import smollm2_135m_instruct

        args.tokenizer = smollm2_135m_instruct()
    report = {"command": "python -m benchmarks scaling " + " ".join(argv if argv is not None else sys.argv[1:])}
    report["environment"] = environment()
    report["results"] = {}
    for shape in shapes:
        report["results"][shape] = run_shape(
            shape, Path(args.workdir), args.tokenizer, args.steps, args.samples, args.in_process, args.keep, args.rounding
        )
        print(shape, report["results"][shape], flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(to_markdown(report))
    return report


if __name__ == "__main__":
    main()
