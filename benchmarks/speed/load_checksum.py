"""What checking each tensor's SHA-256 at load costs, beside reading the same tensors.

    python -m benchmarks load-checksum --out benchmarks --name load_checksum_epyc_avx2

For each size a safetensors file with a W8A8 checkpoint's tensors (int8 decoder linears, fp32
scales, bf16 embeddings and norms; random bytes, shapes from the real config) is written with
digests (hf/checksums.py), then, alternately over `--rounds`: `check_file_digests` (what a load adds)
and `safetensors.torch.load_file` with every tensor copied into memory (the read a load does anyway). Each file is read once before
timing, so both run from the page cache, as a load right after a download or save would.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

from benchmarks import reports_dir
from benchmarks.kernels.build_reports import write_build_reports
from quasar_hf.hf.checksums import check_file_digests, tensor_digests

# (label, layers, hidden, intermediate, kv heads x head dim, vocab): the configs' shapes
SHAPES = [
    ("SmolLM2-135M", 30, 576, 1536, 3 * 64, 49152),
    ("Qwen2.5-0.5B", 24, 896, 4864, 2 * 64, 151936),
    ("Qwen2.5-1.5B", 28, 1536, 8960, 2 * 128, 151936),
]


def checkpoint_tensors(layers: int, hidden: int, inter: int, kv: int, vocab: int) -> dict[str, torch.Tensor]:
    """A W8A8 checkpoint's tensors at this shape (random contents: the cost depends on bytes only)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen).bfloat16()}
    for i in range(layers):
        for name, (out, inp) in {
            "self_attn.q_proj": (hidden, hidden),
            "self_attn.k_proj": (kv, hidden),
            "self_attn.v_proj": (kv, hidden),
            "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (inter, hidden),
            "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }.items():
            prefix = f"model.layers.{i}.{name}"
            tensors[f"{prefix}.weight"] = torch.randint(-127, 128, (out, inp), dtype=torch.int8, generator=gen)
            tensors[f"{prefix}.weight_scale"] = torch.rand(out, generator=gen)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    return tensors


def measure(label: str, shape: tuple, rounds: int, folder: str) -> dict:
    tensors = checkpoint_tensors(*shape)
    path = os.path.join(folder, f"{label}.safetensors")
    started = time.perf_counter()
    metadata = {"format": "pt", **tensor_digests(tensors.items())}
    digest_s = time.perf_counter() - started
    save_file(tensors, path, metadata=metadata)
    del tensors
    load_file(path)  # into the page cache
    check, read = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        checked = check_file_digests(path)
        check.append(time.perf_counter() - started)
        started = time.perf_counter()
        loaded = {name: t.clone() for name, t in load_file(path).items()}  # load_file maps lazily: copy = read
        read.append(time.perf_counter() - started)
        del loaded
    size = os.path.getsize(path)
    os.remove(path)
    check_s, read_s = statistics.median(check), statistics.median(read)
    return {
        "model": label,
        "bytes": size,
        "tensors_checked": checked,
        "digest_at_save_s": round(digest_s, 3),
        "check_s": round(check_s, 4),
        "read_s": round(read_s, 4),
        "check_gb_per_s": round(size / check_s / 1e9, 2),
        "check_over_read": round(check_s / read_s, 2),
    }


def to_markdown(result: dict, command: str) -> str:
    lines = [
        "# SHA-256 check at load vs reading the tensors",
        "",
        f"`{command}`",
        "",
        "| model shape | file GB | digest at save s | check at load s | read (load_file + copy) s | check GB/s | check / read |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['bytes'] / 1e9:.2f} | {r['digest_at_save_s']} | {r['check_s']} | {r['read_s']} | "
            f"{r['check_gb_per_s']} | {r['check_over_read']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks load-checksum", description=__doc__)
    parser.add_argument("--shapes", nargs="*", help=f"labels among {[s[0] for s in SHAPES]} (default all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=reports_dir("load-checksum"))
    parser.add_argument("--name", default="load_checksum")
    args = parser.parse_args(argv)
    chosen = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes]
    if not chosen:
        parser.error(f"--shapes: choose among {[s[0] for s in SHAPES]}")
    with tempfile.TemporaryDirectory() as folder:
        rows = [measure(label, shape, args.rounds, folder) for label, *shape in chosen]
    for row in rows:
        print(row)
    return write_build_reports({"rows": rows}, args.out, args.name, parser.prog, argv, to_markdown)
