"""Task accuracy of a Quasar model vs its unquantized original with lm-evaluation-harness.

`compare_tasks` runs the same lm-eval tasks on the reference (lm-eval's own "hf" model) and on
the W8A8 model (`QuasarLM`: generation tasks decode with Quasar), optionally also on the W8A8
model with plain decoding (`plain_w8a8=True`: its wall time, and a check that Quasar decoding
generated exactly the same text). It returns a JSON-ready result with per-metric scores,
recovery % (W8A8 / reference) and wall time per variant; `to_markdown` renders it.
`eval_main(argv)` is the command line (`quasar-hf eval --tasks ...`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from .accuracy import recovery_pct
from .loading import add_quantize_arguments
from .report import environment, environment_lines, fmt, publish, table

_IGNORED_KEYS = {"alias", "name", "sample_len", "samples", " "}


def run_tasks(
    lm: Any,
    tasks: list[str],
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    apply_chat_template: bool = False,
) -> dict[str, Any]:
    """Run lm-eval on one model; {"scores": {task: {metric: value}}, "outputs", "wall_time_s", ...}."""
    import lm_eval

    from .tasks import task_manager_for, task_specs

    specs = task_specs(tasks)
    started = time.perf_counter()
    raw = lm_eval.simple_evaluate(
        model=lm,
        tasks=specs,
        task_manager=task_manager_for(specs),
        limit=limit,
        num_fewshot=num_fewshot,
        bootstrap_iters=0,  # scores only; stderr bootstraps cost minutes on large tasks
        log_samples=True,
        apply_chat_template=apply_chat_template,
    )
    wall = time.perf_counter() - started
    return {
        "scores": scores_of(raw),
        "higher_is_better": raw.get("higher_is_better", {}),
        "outputs": generated_outputs(raw),
        "num_samples": {task: len(rows) for task, rows in (raw.get("samples") or {}).items()},
        "wall_time_s": wall,
    }


def scores_of(raw: dict[str, Any]) -> dict[str, dict[str, float]]:
    """lm-eval's results -> {task: {"metric,filter": value}} (numbers only, no stderr)."""
    scores: dict[str, dict[str, float]] = {}
    for task, metrics in (raw.get("results") or {}).items():
        scores[task] = {
            key: float(value)
            for key, value in metrics.items()
            if key not in _IGNORED_KEYS
            and "_stderr" not in key
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
        }
    return scores


def generated_outputs(raw: dict[str, Any]) -> dict[str, list[str]]:
    """The raw generated text of each generate_until request, by task (in document order)."""
    outputs: dict[str, list[str]] = {}
    for task, samples in (raw.get("samples") or {}).items():
        rows = sorted(samples, key=lambda s: s["doc_id"])
        texts = [resp for s in rows for resps in s.get("resps", []) for resp in resps if isinstance(resp, str)]
        if texts:
            outputs[task] = texts
    return outputs


def compare_tasks(
    quantized_model: Any,
    reference_model: Any,
    tokenizer: Any,
    tasks: list[str],
    *,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    plain_w8a8: bool = False,
    quasar: bool | dict = True,
    apply_chat_template: bool = False,
) -> dict[str, Any]:
    """Scores, recovery and wall times of the W8A8 model (Quasar decoding) vs the reference."""
    from lm_eval.models.huggingface import HFLM

    from .lm_eval_model import QuasarLM, mean_acceptance_length

    options = dict(limit=limit, num_fewshot=num_fewshot, apply_chat_template=apply_chat_template)
    reference = run_tasks(HFLM(pretrained=reference_model, tokenizer=tokenizer, batch_size=batch_size), tasks, **options)
    quasar_lm = QuasarLM(pretrained=quantized_model, tokenizer=tokenizer, batch_size=batch_size, quasar=quasar)
    quantized = run_tasks(quasar_lm, tasks, **options)
    quantized["quasar_decoding"] = quasar_lm.quasar_decoding
    quantized["mean_acceptance_length"] = mean_acceptance_length(quasar_lm.quasar_stats)
    variants = {"reference": reference, "w8a8_quasar": quantized}
    if plain_w8a8:
        plain = QuasarLM(pretrained=quantized_model, tokenizer=tokenizer, batch_size=batch_size, quasar=False)
        variants["w8a8_plain"] = run_tasks(plain, tasks, **options)
        quantized["generations_equal_plain_w8a8"] = quantized["outputs"] == variants["w8a8_plain"]["outputs"]
    return {
        "tasks": tasks,
        "settings": {"limit": limit, "num_fewshot": num_fewshot, "batch_size": batch_size, "quasar": str(quasar)},
        "rows": comparison_rows(reference["scores"], quantized["scores"], reference["higher_is_better"]),
        "variants": variants,
        "environment": environment(),
    }


def comparison_rows(reference: dict, quantized: dict, higher_is_better: dict | None = None) -> list[dict[str, Any]]:
    """One row per (task, metric) present in both runs, with recovery %."""
    rows = []
    for task, metrics in reference.items():
        for key, value in metrics.items():
            other = quantized.get(task, {}).get(key)
            metric = key.split(",")[0]
            rows.append(
                {
                    "task": task,
                    "metric": key,
                    "reference": value,
                    "quantized": other,
                    "recovery_pct": recovery_pct(other, value),
                    "higher_is_better": (higher_is_better or {}).get(task, {}).get(metric),
                }
            )
    return rows


def to_markdown(result: dict[str, Any], title: str = "Task accuracy: W8A8 (Quasar) vs the unquantized model") -> str:
    """The comparison as markdown: scores + recovery, wall times, exactness, environment, command."""
    lines = [f"# {title}", ""]
    if result.get("models"):
        lines += [f"- {role}: `{path}`" for role, path in result["models"].items()] + [""]
    header = ["task", "metric", "reference", "W8A8", "recovery %"]
    lines += table(header, [[r["task"], r["metric"], r["reference"], r["quantized"], r["recovery_pct"]] for r in result["rows"]])
    lines += ["", "Recovery = W8A8 score / reference score x 100.", ""]
    rows = []
    for name, variant in result["variants"].items():
        rows.append(
            [
                name,
                variant["wall_time_s"],
                variant.get("mean_acceptance_length"),
                variant.get("generations_equal_plain_w8a8"),
            ]
        )
    lines += table(["variant", "wall time (s)", "L (tokens / verify step)", "generations == plain W8A8 greedy"], rows)
    settings = result.get("settings", {})
    lines += ["", "Settings: " + ", ".join(f"{k}={fmt(v)}" for k, v in settings.items()), ""]
    lines += ["Environment:", ""] + environment_lines(result.get("environment", {}))
    if result.get("command"):
        lines += ["", "Command:", "", "```bash", result["command"], "```"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quasar-hf eval",
        description="Task accuracy (lm-evaluation-harness) of a Quasar W8A8 model vs its unquantized original",
    )
    parser.add_argument(
        "model",
        help="a Quasar checkpoint, or an unquantized checkpoint to quantize now with QuasarConfig() ('smollm2' = embedded)",
    )
    parser.add_argument("--reference", help="the unquantized original (default: MODEL itself when it is unquantized)")
    parser.add_argument(
        "--tasks",
        required=True,
        help="comma-separated lm-eval task names, task YAML files, or the shipped offline tasks quasar_tiny_mc,quasar_tiny_gen",
    )
    parser.add_argument("--limit", type=float, help="examples per task (an integer), or a fraction below 1")
    parser.add_argument("--num-fewshot", type=int)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="dtype of both models")
    parser.add_argument("--apply-chat-template", action="store_true", help="format prompts with the tokenizer's chat template")
    parser.add_argument("--plain-w8a8", action="store_true", help="also run the W8A8 model with plain decoding (time, exactness)")
    parser.add_argument("--num-draft-tokens", type=int, default=5, help="n-gram draft length of Quasar decoding")
    parser.add_argument("--out", default="eval_results", help="folder for NAME.json and NAME.md")
    parser.add_argument("--name", default="lm_eval", help="report file name (without extension)")
    parser.add_argument(
        "--record", action="store_true", help="record the accuracy in the Quasar checkpoint's config and model card"
    )
    add_quantize_arguments(parser)
    return parser


def eval_main(argv: list[str] | None = None) -> int:
    """`quasar-hf eval --tasks ...`: run, print the markdown table, write JSON + markdown."""
    args = build_parser().parse_args(argv)
    from .loading import load_pair, quantize_options
    from .tasks import check_task_names, task_specs

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    check_task_names(task_specs(tasks))  # before the (slow) model loading
    pair = load_pair(args.model, args.reference, args.dtype, quantize_options(args))
    result = compare_tasks(
        pair.quantized,
        pair.reference,
        pair.tokenizer,
        tasks,
        limit=limit,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        plain_w8a8=args.plain_w8a8,
        quasar={"num_draft_tokens": args.num_draft_tokens},
        apply_chat_template=args.apply_chat_template,
    )
    result["models"] = {"W8A8": pair.quantized_source, "reference": pair.reference_source}
    result["command"] = " ".join(["quasar-hf", "eval", *(sys.argv[1:] if argv is None else argv)])
    publish(result, to_markdown(result), args.out, args.name, pair.quantized_path if args.record else None, "the accuracy")
    return 0
