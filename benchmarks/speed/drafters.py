"""Drafters compared on a real checkpoint, two prompt suites, W8A8 verification (CPU).

    python -m benchmarks drafters --model smollm2 --draft-layers auto --draft-vocab-sizes 2048,8192 \
        --prompts grounded=8,open=20 --max-new-tokens 96 --no-bf16-draft-layers \
        --out benchmarks/reports/drafters/draft_compare_smollm2_cpu.json --markdown benchmarks/reports/drafters/draft_compare_smollm2_cpu.md

(benchmarks/reports/drafters/draft_compare_cpu.md lists the commands of every committed run.)

Suites: "grounded" (rewrite / edit / summarise / extract: output copies the input) and "open"
(chat questions, stories, explanations: little to copy). Variants, interleaved per prompt
(the order rotates): plain W8A8 greedy (`generate`), n-gram, self-drafting with INT8 draft layers
(the verify layers) and with BF16 draft-layer copies, each with the full lm_head and with reduced
draft heads of each size, auto (n-gram / reduced-head self / none per step, adaptive), and the
BF16 baselines (plain BF16 greedy; n-gram with BF16 verification). Greedy; every variant's output
is compared with plain W8A8 greedy (bf16 near-ties aside it must be equal).

Per variant and suite: tokens/s (median over prompts), speed vs plain W8A8 (median of per-prompt
ratios), L, draft ms per drafted token, weight bytes read per drafted token (draft layers + head
rows; n-gram: 0) next to the verify step's bytes. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from importlib import resources

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quasar_hf  # noqa: F401
from quasar_hf import QuasarConfig, speculative_generate
from quasar_hf.bench.report import environment
from quasar_hf.bench.suites import load_suite, render_prompt
from quasar_hf.detect import plain_decoding
from quasar_hf.models import smollm2_135m_instruct
from quasar_hf.nn.weight_bytes import module_bytes
from quasar_hf.self_draft.head import (
    attach_draft_head,
    draft_bytes_per_token,
    select_head_tokens,
    special_token_ids,
    token_counts,
)
from quasar_hf.smoothquant.data import build_calibration_blocks, load_calibration_texts
from quasar_hf.speculative import QuasarGenerationConfig
from quasar_hf.speculative.auto_drafter import AutoDrafter, auto_factory


@dataclass
class Variant:
    name: str
    model: torch.nn.Module
    drafter: str | None  # None: plain generate
    head_size: int | None = None  # reduced draft head to attach before running
    kwargs: dict | None = None  # drafter_kwargs (auto: ngram=False = adaptive self-drafting alone)


def suite_items(name: str) -> list[dict]:
    """Packaged suites by name; "open" is read from its file (it is not part of the bench runner's "all")."""
    if name == "open":
        return load_suite(str(resources.files("quasar_hf").joinpath("data", "prompts", "open.jsonl")))
    return load_suite(name)


def prompts_per_suite(spec: str, suites: list[str]) -> dict[str, int]:
    """--prompts "12" (every suite) or "grounded=8,open=20" -> {suite: count}."""
    if "=" not in spec:
        return {s: int(spec) for s in suites}
    counts = {name.strip(): int(n) for name, n in (part.split("=") for part in spec.split(","))}
    missing = [s for s in suites if s not in counts]
    if missing:
        raise SystemExit(f"--prompts {spec!r} gives no count for suites {missing}")
    return counts


def head_indices(model, tokenizer, sizes: list[int]) -> dict[int, torch.Tensor]:
    """Top-N token ids for each N, counted on the same calibration blocks the quantizer used."""
    cfg = model.config.quantization_config
    texts, _ = load_calibration_texts(None)  # the script quantizes with the offline default data
    blocks = build_calibration_blocks(texts, tokenizer, cfg.num_calibration_samples, cfg.calibration_seq_len, cfg.seed)
    counts = token_counts(blocks, model.get_output_embeddings().weight.shape[0])
    return {n: select_head_tokens(counts, n, special_token_ids(model)) for n in sizes}


def load_models(path: str, layers, sizes: list[int], bf16_baselines: bool, bf16_layers: bool, calibration: dict) -> dict:
    def quasar(dtype, draft_layers):
        config = QuasarConfig(draft_layers=draft_layers, draft_dtype=dtype, draft_vocab_size=max(sizes), **calibration)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=config).eval()

    int8 = quasar("int8", layers)
    chosen = int8.config.quantization_config.draft_info["layers"]  # "auto" searches once
    models = {"int8": int8}
    if bf16_layers:
        models["bf16_layers"] = quasar("model", chosen)
    if bf16_baselines:
        models["bf16"] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    return models


def build_variants(models: dict, sizes: list[int]) -> list[Variant]:
    int8 = models["int8"]
    variants = [Variant("plain_w8a8", int8, None), Variant("ngram", int8, "ngram")]
    paths = [("int8", int8)] + ([("bf16", models["bf16_layers"])] if "bf16_layers" in models else [])
    for label, model in paths:
        variants.append(Variant(f"self_{label}_layers_full_head", model, "self"))
        variants += [Variant(f"self_{label}_layers_head{n}", model, "self_reduced", n) for n in sizes]
    variants.append(Variant(f"self_adaptive_int8_layers_head{sizes[0]}", int8, "auto", sizes[0], {"ngram": False}))
    variants.append(Variant(f"auto_head{sizes[0]}", int8, "auto", sizes[0]))
    if "bf16" in models:
        variants += [Variant("plain_bf16", models["bf16"], None), Variant("ngram_bf16_verify", models["bf16"], "ngram")]
    return variants


def run_variant(variant: Variant, heads: dict, ids: torch.Tensor, max_new_tokens: int, num_draft: int, pad: int) -> dict:
    model = variant.model
    if variant.head_size is not None:
        attach_draft_head(model, heads[variant.head_size])
    mask = torch.ones_like(ids)
    started = time.perf_counter()
    if variant.drafter is None:
        sequences = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, **plain_decoding(model)
        )
        seconds = time.perf_counter() - started
        return {"sequence": sequences[0], "seconds": seconds, "stats": None, "auto": None}
    config = QuasarGenerationConfig(drafter=variant.drafter, num_draft_tokens=num_draft, drafter_kwargs=variant.kwargs or {})
    drafter = auto_factory(model, config) if variant.drafter == "auto" else variant.drafter
    config.drafter = drafter
    out = speculative_generate(
        model,
        ids,
        mask,
        quasar_config=config,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_dict_in_generate=True,
        pad_token_id=pad,
    )
    seconds = time.perf_counter() - started
    auto = drafter.summary() if isinstance(drafter, AutoDrafter) else None
    return {"sequence": out.sequences[0], "seconds": seconds, "stats": out.quasar_stats, "auto": auto}


def bytes_per_draft_token(variant: Variant, heads: dict, result: dict) -> float | None:
    """Weight bytes read per drafted token (None for plain decoding; 0 for n-gram drafts)."""
    if variant.drafter is None:
        return None
    if variant.drafter == "ngram":
        return 0.0
    if variant.head_size is not None:
        attach_draft_head(variant.model, heads[variant.head_size])
    per_token = draft_bytes_per_token(variant.model, reduced=variant.drafter != "self")["draft_bytes_per_token"]
    if variant.drafter == "auto":
        tokens = result["auto"]["tokens_by_source"]
        drafted = tokens["ngram"] + tokens["model"]
        return per_token * tokens["model"] / drafted if drafted else 0.0
    return float(per_token)


def record(variant, heads, ids, result) -> dict:
    new = result["sequence"].shape[0] - ids.shape[1]
    stats = result["stats"]
    row = {"new_tokens": new, "seconds": result["seconds"], "tokens_per_s": new / result["seconds"]}
    if stats is not None:
        row.update(
            verify_steps=stats.verify_steps,
            drafted_tokens=stats.drafted_tokens,
            draft_s=stats.draft_time_s,
            L=stats.mean_acceptance_length,
            draft_bytes_per_token=bytes_per_draft_token(variant, heads, result),
        )
    if result["auto"] is not None:
        row["auto"] = result["auto"]
    return row


def summarize(rows: list[dict], plain_rows: list[dict]) -> dict:
    out = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "speed_vs_plain_w8a8": statistics.median(r["tokens_per_s"] / p["tokens_per_s"] for r, p in zip(rows, plain_rows)),
        "equal_to_plain_w8a8": f"{sum(r['equal_to_plain'] for r in rows)}/{len(rows)}",
    }
    if "verify_steps" in rows[0]:
        steps, drafted = sum(r["verify_steps"] for r in rows), sum(r["drafted_tokens"] for r in rows)
        out["L"] = sum(r["new_tokens"] for r in rows) / max(1, steps)
        out["draft_ms_per_token"] = 1e3 * sum(r["draft_s"] for r in rows) / drafted if drafted else None
        weighted = sum(r["draft_bytes_per_token"] * r["drafted_tokens"] for r in rows)
        out["draft_bytes_per_token"] = weighted / drafted if drafted else 0.0
    return out


def markdown(report: dict) -> str:
    lines = [f"Command: `{report['command']}`", "", f"Load average during the run: {report['load_average']}", ""]
    info = report["draft_info"]["int8"]
    lines.append(
        f"- draft path: layers {info['layers']} ({info['selection']}); top-1 agreement {info['top1_agreement']} "
        f"with the float model on calibration text; draft/verify bytes {info.get('draft_over_verify_bytes')}; "
        f"predicted bytes-bound speedup {info.get('predicted_speedup')} at k = {info.get('predicted_best_draft_tokens')}"
    )
    for c in info.get("candidates") or []:
        lines.append(
            f"  - {c['num_layers']} layers: agreement {c['top1_agreement']}, draft/verify bytes {c['draft_over_verify']}, "
            f"predicted {c['predicted_speedup']}x at k = {c['draft_tokens']}"
        )
    for suite, cover in report["head_coverage"].items():
        lines.append(f"- suite `{suite}`: share of plain W8A8 output tokens inside each reduced head: {cover}")
    for name, info in report["bytes"].items():
        lines.append(f"- {name}: {info}")
    for suite, table in report["summary"].items():
        lines += ["", f"### Suite `{suite}`", ""]
        lines += ["| variant | tokens/s | vs plain W8A8 | L | draft ms / token | draft MB / token | equal to plain |"]
        lines += ["|---|---|---|---|---|---|---|"]
        for variant, s in table.items():
            ms = s.get("draft_ms_per_token")
            mb = s.get("draft_bytes_per_token")
            lines.append(
                f"| {variant} | {s['tokens_per_s']:.1f} | {s['speed_vs_plain_w8a8']:.2f}x | {s.get('L', 1.0):.2f} | "
                f"{'-' if ms is None else f'{ms:.2f}'} | {'-' if mb is None else f'{mb / 1e6:.2f}'} | {s['equal_to_plain_w8a8']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help='"smollm2" or a local checkpoint folder (e.g. Qwen2.5-Coder-0.5B)')
    parser.add_argument("--draft-layers", required=True, help='comma-separated layer indices, or "auto"')
    parser.add_argument("--draft-vocab-sizes", default="8192", help="comma-separated reduced draft head sizes N")
    parser.add_argument("--suites", default="grounded,open")
    parser.add_argument("--prompts", default="12", help='prompts per suite: N for every suite, or e.g. "grounded=8,open=20"')
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--no-bf16-baselines", action="store_true")
    parser.add_argument("--no-bf16-draft-layers", action="store_true", help="skip the variants with BF16 draft-layer copies")
    parser.add_argument(
        "--variants", default=None, help="comma-separated variant names to run (default: all; plain_w8a8 always runs)"
    )
    parser.add_argument("--alpha", default="auto", help='SmoothQuant alpha ("auto" or a float; a float quantizes faster)')
    parser.add_argument("--calibration-samples", type=int, default=32)
    parser.add_argument("--calibration-seq-len", type=int, default=512)
    parser.add_argument("--out", default="draft_compare.json", help="JSON report (the committed runs name theirs)")
    parser.add_argument("--markdown", default=None, help="also write the tables to this markdown file")
    args = parser.parse_args(argv)
    layers = "auto" if args.draft_layers == "auto" else [int(i) for i in args.draft_layers.split(",")]
    sizes = [int(n) for n in args.draft_vocab_sizes.split(",")]
    path = smollm2_135m_instruct() if args.model == "smollm2" else os.path.expanduser(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    calibration = {
        "alpha": args.alpha if args.alpha == "auto" else float(args.alpha),
        "num_calibration_samples": args.calibration_samples,
        "calibration_seq_len": args.calibration_seq_len,
    }
    models = load_models(path, layers, sizes, not args.no_bf16_baselines, not args.no_bf16_draft_layers, calibration)
    heads = head_indices(models["int8"], tok, sizes)
    variants = build_variants(models, sizes)
    if args.variants:
        wanted = {"plain_w8a8", *args.variants.split(",")}
        unknown = wanted - {v.name for v in variants}
        if unknown:
            raise SystemExit(f"unknown --variants {sorted(unknown)}; known: {[v.name for v in variants]}")
        variants = [v for v in variants if v.name in wanted]
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    counts = prompts_per_suite(args.prompts, suites)
    prompts = {s: [torch.tensor([render_prompt(it, tok)]) for it in suite_items(s)[: counts[s]]] for s in suites}
    warm = prompts[suites[0]][0]
    for variant in variants:  # kernel binding, caches: outside the timed runs
        run_variant(variant, heads, warm, 4, args.num_draft_tokens, pad)

    raw: dict = {s: {v.name: [] for v in variants} for s in suites}
    coverage: dict = {s: {n: [] for n in sizes} for s in suites}
    for suite in suites:
        for i, ids in enumerate(prompts[suite]):
            order = variants[i % len(variants) :] + variants[: i % len(variants)]
            results = {v.name: run_variant(v, heads, ids, args.max_new_tokens, args.num_draft_tokens, pad) for v in order}
            plain = results["plain_w8a8"]["sequence"]
            generated = plain[ids.shape[1] :]
            for n in sizes:
                coverage[suite][n].append(float(torch.isin(generated, heads[n]).float().mean()))
            for v in variants:
                row = record(v, heads, ids, results[v.name])
                row["equal_to_plain"] = bool(torch.equal(results[v.name]["sequence"], plain))
                raw[suite][v.name].append(row)
            print(suite, i, {name: round(r[-1]["tokens_per_s"], 1) for name, r in raw[suite].items()}, flush=True)

    summary = {s: {name: summarize(rows, raw[s]["plain_w8a8"]) for name, rows in raw[s].items()} for s in suites}
    byte_info = {"verify_step": draft_bytes_per_token(models["int8"], reduced=False)["verify_bytes_per_step"]}
    byte_info["model_bytes"] = {k: module_bytes(m) for k, m in models.items()}
    report = {
        "command": "python -m benchmarks drafters "
        + " ".join(
            f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items() if v not in (None, False)
        ),
        "draft_info": {k: m.config.quantization_config.draft_info for k, m in models.items() if k != "bf16"},
        "bytes": byte_info,
        "summary": summary,
        "head_coverage": {s: {n: statistics.mean(coverage[s][n]) for n in sizes} for s in suites},
        "raw": raw,
        "load_average": os.getloadavg(),
        "environment": environment(),
    }
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    text = markdown(report)
    print(text)
    print("head coverage of plain W8A8 output:", report["head_coverage"])
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
