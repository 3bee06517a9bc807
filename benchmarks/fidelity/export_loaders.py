"""Who reads a compressed-tensors export right: Transformers' loader against the Quasar model it came from.

    python -m benchmarks export-loaders --checkpoint rotated=QUASAR_DIR --checkpoint unrotated=QUASAR_NOROT_DIR --out DIR
    python -m benchmarks export-loaders --tiny --out DIR        # mechanics: a random tiny Llama, both kinds

Per checkpoint: export it (`export_compressed_tensors`), load the export with
`AutoModelForCausalLM.from_pretrained` (Transformers' compressed-tensors quantizer, which does not
apply `transform_config`), and compare its next-token logits with the Quasar model's on the prompts
below: relative L2 error of the logits and argmax agreement over every position. An export whose
linears take a rotated input is read wrong there; the export's card and config.json say so (vLLM
applies the transform: `python -m benchmarks vllm-check`). Writes DIR/export_loaders.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday.",
    "Water boils at 100 degrees Celsius at sea level because",
)


def compare_logits(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Relative L2 error and argmax agreement of two [T, V] logit tensors."""
    reference, other = reference.float(), other.float()
    return {
        "relative_error": float((other - reference).norm() / reference.norm()),
        "argmax_agreement": float((other.argmax(-1) == reference.argmax(-1)).float().mean()),
        "positions": int(reference.shape[0]),
    }


def measure(name: str, folder: str, work: Path) -> dict:
    """Export `folder` and load the export with Transformers; its logits against the Quasar model's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quasar_hf.export.compressed_tensors import export_compressed_tensors

    tokenizer = AutoTokenizer.from_pretrained(folder)
    quasar = AutoModelForCausalLM.from_pretrained(folder).eval()
    out = work / f"{name}-ct"
    report = export_compressed_tensors(quasar, out, tokenizer=tokenizer)
    start = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=quasar.dtype).eval()
    load_s = time.perf_counter() - start
    config = json.loads((out / "config.json").read_text())
    row = {
        "name": name,
        "checkpoint": folder,
        "rotated_modules": len(report.rotated_modules),
        "transformers_load_s": round(load_s, 2),
        "from_pretrained": scores(quasar, loaded, tokenizer),
        "config_says": config.get("quasar_export", {}).get("transformers"),
    }
    card = (out / "README.md").read_text()
    recipes = re.findall(r"```python\n(.*?)```", card, flags=re.S)
    if recipes:  # the card's way for Transformers: from_pretrained, then the transforms applied
        namespace: dict = {}
        exec(re.sub(r'path = ".*?"', f"path = {str(out)!r}", recipes[0], count=1), namespace)
        row["card_recipe"] = scores(quasar, namespace["model"].eval(), tokenizer)
    return row


def scores(quasar, loaded, tokenizer) -> dict:
    """Logit error and argmax agreement of `loaded` against the Quasar model, over PROMPTS."""
    rows = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            rows.append(compare_logits(quasar(ids).logits[0], loaded(ids).logits[0]))
    positions = sum(r["positions"] for r in rows)
    return {
        "relative_error_max": max(r["relative_error"] for r in rows),
        "relative_error_min": min(r["relative_error"] for r in rows),
        "argmax_agreement": sum(r["argmax_agreement"] * r["positions"] for r in rows) / positions,
        "positions": positions,
    }


def tiny_checkpoints(work: Path) -> dict[str, str]:
    """A random tiny Llama quantized twice: with the default rotation and without."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from quasar_hf import QuasarConfig
    from quasar_hf.models import smollm2_135m_instruct

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=49152)
    torch.manual_seed(0)
    source = work / "tiny-src"
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(source)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_135m_instruct())
    tokenizer.save_pretrained(source)
    folders = {}
    for name, rotate in (("rotated", ["down_proj"]), ("unrotated", [])):
        options = QuasarConfig(num_calibration_samples=4, calibration_seq_len=64, rotate=rotate, weight_rounding="nearest")
        model = AutoModelForCausalLM.from_pretrained(source, quantization_config=options, dtype=torch.bfloat16)
        model.save_pretrained(work / name)
        tokenizer.save_pretrained(work / name)
        folders[name] = str(work / name)
    return folders


def to_markdown(result: dict) -> str:
    lines = [
        "# Compressed-tensors exports read by Transformers",
        "",
        f"`{result['command']}`",
        "",
        "| export | rotated linears | Transformers loading | logits rel. error vs Quasar (min-max over prompts) "
        "| argmax agreement | positions |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        for how in ("from_pretrained", "card_recipe"):
            if how in row:
                got = row[how]
                label = "from_pretrained" if how == "from_pretrained" else "from_pretrained + the card's transform recipe"
                lines.append(
                    f"| {row['name']} | {row['rotated_modules']} | {label} | {got['relative_error_min']:.3f}-"
                    f"{got['relative_error_max']:.3f} | {got['argmax_agreement']:.3f} | {got['positions']} |"
                )
    lines += ["", "What each export's config.json says (`quasar_export.transformers`):", ""]
    lines += [f"- {row['name']}: {row['config_says']}" for row in result["rows"]]
    env = result["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    lines += ["", f"Environment: {env['cpu']}, {versions}, commit {env['git_commit']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import sys

    from quasar_hf.bench.report import environment

    parser = argparse.ArgumentParser(prog="python -m benchmarks export-loaders", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=QUASAR_DIR")
    parser.add_argument("--tiny", action="store_true", help="random tiny checkpoints (mechanics only)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folders = dict(item.split("=", 1) for item in args.checkpoint)
        if args.tiny:
            folders.update(tiny_checkpoints(work))
        if not folders:
            parser.error("give --checkpoint NAME=QUASAR_DIR (repeatable) or --tiny")
        rows = [measure(name, folder, work) for name, folder in folders.items()]
    command = "python -m benchmarks export-loaders " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command, "rows": rows, "environment": environment()}
    (out / "export_loaders.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "export_loaders.md").write_text(to_markdown(result))
    print(to_markdown(result))
    return 0
