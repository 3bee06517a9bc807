"""`quasar-hf`: quantize, generate, export, bench, eval and demo from the command line.

Exit codes: 0 ok, 1 runtime failure, 2 usage error. Errors print as one line
(`quasar-hf <command>: error: ...`); `--debug` shows the traceback. Heavy imports happen inside
the subcommands, so `--help` is instant and always works.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable, Sequence

from quasar_hf.commands.loading import DTYPES, UsageError

DRAFTERS = ("ngram", "assistant", "self")


def alpha_value(text: str) -> float | str:
    """--alpha: a float in [0, 1] or 'auto'."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"alpha must be a number in [0, 1] or 'auto', got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"alpha must be in [0, 1] (SmoothQuant migration strength), got {value}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def draft_layers_value(text: str) -> list[int] | str:
    """--draft-layers: 'auto' or comma-separated layer indices."""
    if text == "auto":
        return text
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"draft layers must be 'auto' or indices like 0,1,2; got {text!r}") from None


# ----------------------------------------------------------------------------- subcommands
def cmd_quantize(args: argparse.Namespace) -> int:
    from quasar_hf.commands.loading import load_tokenizer, quantize_checkpoint, resolve_model, save_quantized

    path = resolve_model(args.model)
    options = {"alpha": args.alpha, "num_calibration_samples": args.num_samples, "calibration_seq_len": args.seq_len}
    if args.calibration_dataset is not None:
        options["calibration_dataset"] = args.calibration_dataset
    if args.draft_layers is not None:
        options["draft_layers"] = args.draft_layers
    start = time.perf_counter()
    model = quantize_checkpoint(path, options, args.dtype)
    tokenizer = load_tokenizer(path)
    save_quantized(model, tokenizer, args.out)
    qconfig = model.config.quantization_config
    count = len(getattr(qconfig, "quantized_modules", None) or [])
    print(f"quantized {count} linear layers to W8A8 in {time.perf_counter() - start:.1f} s; saved to {args.out}")
    if args.push_to_hub:
        from quasar_hf.hf.hub import push_quasar_model

        commit = push_quasar_model(model, args.push_to_hub, tokenizer=tokenizer, token=args.token, private=args.private)
        print(f"pushed to {commit.commit_url}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    from quasar_hf.commands.generation import describe, run_generation
    from quasar_hf.commands.loading import encode_prompt, is_quasar_checkpoint, load_model, load_tokenizer, resolve_model

    if args.drafter == "assistant" and not args.assistant:
        raise UsageError("--drafter assistant needs --assistant MODEL (a small model sharing the tokenizer)")
    if args.assistant and args.drafter != "assistant":
        raise UsageError("--assistant is only used with --drafter assistant")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    path = resolve_model(args.model)
    model = load_model(path, dtype=args.dtype)
    tokenizer = load_tokenizer(path)
    quasar = None
    if not args.no_quasar:
        from quasar_hf.speculative import QuasarGenerationConfig

        if not is_quasar_checkpoint(path):
            print(
                f"note: {args.model} is not a Quasar W8A8 checkpoint; its own weights verify the drafts "
                "(run `quasar-hf quantize` first for the W8A8 verifier)",
                file=sys.stderr,
            )
        assistant = load_model(resolve_model(args.assistant), dtype=args.dtype) if args.assistant else None
        quasar = QuasarGenerationConfig(drafter=args.drafter, num_draft_tokens=args.num_draft_tokens, assistant_model=assistant)
    input_ids = encode_prompt(tokenizer, args.prompt, use_chat_template=not args.no_chat_template)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if args.stream else None
    result = run_generation(
        model,
        tokenizer,
        input_ids,
        quasar=quasar,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        streamer=streamer,
    )
    if not args.stream:
        print(result.text)
    print(describe("quasar" if quasar is not None else "plain", result), file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from quasar_hf.commands.loading import is_quasar_checkpoint, load_model, load_tokenizer, resolve_model
    from quasar_hf.export.compressed_tensors import export_compressed_tensors

    path = resolve_model(args.model)
    if not is_quasar_checkpoint(path):
        raise UsageError(f"{args.model} is not a Quasar W8A8 checkpoint; run `quasar-hf quantize {args.model} --out DIR` first")
    model = load_model(path)
    report = export_compressed_tensors(
        model, args.out, tokenizer=load_tokenizer(path), fold_act_prescale=not args.no_fold_prescale
    )
    print(
        f"wrote {len(report.quantized_modules)} W8A8 linears (compressed-tensors int-quantized) to {args.out}; "
        f"high precision: {', '.join(report.ignored_modules) or 'none'}"
    )
    if report.folded_prescale_modules:
        print(
            f"folded act_prescale into {len(report.folded_prescale_modules)} weights "
            f"(max relative weight error {report.max_fold_rel_error:.2e})"
        )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Pass every option through to the benchmark runner (`python -m quasar_hf.bench.runner`)."""
    from quasar_hf.bench.runner import bench_main

    passthrough = [arg for arg in args.bench_args if arg != "--debug"]
    for written in bench_main(passthrough):
        print(f"wrote {written}")
    return 0


def _eval_texts(args: argparse.Namespace) -> list[str] | None:
    if args.text_file:
        try:
            with open(args.text_file, encoding="utf-8") as handle:
                return [handle.read()]
        except OSError as error:
            raise UsageError(f"cannot read --text-file {args.text_file}: {error.strerror}") from None
    if args.dataset:
        from datasets import load_dataset

        rows = load_dataset(args.dataset, split=args.split)
        if args.text_column not in rows.column_names:
            raise UsageError(f"dataset {args.dataset} has no column {args.text_column!r}; columns: {rows.column_names}")
        return [text for text in rows[args.text_column] if text]
    return None


def cmd_eval(args: argparse.Namespace) -> int:
    from quasar_hf.bench.fidelity import evaluate_fidelity
    from quasar_hf.commands.loading import is_quasar_checkpoint, load_model, load_tokenizer, resolve_model

    path, reference_path = resolve_model(args.model), resolve_model(args.reference)
    if args.record and not is_quasar_checkpoint(path):
        raise UsageError(f"--record writes into a local Quasar checkpoint folder; {args.model} is not one")
    texts = _eval_texts(args)
    model = load_model(path)
    reference = load_model(reference_path, dtype=args.dtype)
    result = evaluate_fidelity(model, reference, load_tokenizer(path), texts, seq_len=args.seq_len, max_windows=args.max_windows)
    scores = result["next_token"]
    print(
        f"perplexity {scores['perplexity_model']:.4f} vs reference {scores['perplexity_reference']:.4f} "
        f"(ratio {scores['perplexity_ratio']:.4f})"
    )
    print(
        f"top-1 agreement {scores['top1_agreement']:.4f}; mean KL(reference || model) {scores['mean_kl_nats']:.5f} nats; "
        f"{scores['tokens_evaluated']} tokens ({result['config']['text_source']})"
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2, default=str)
        print(f"wrote {args.json}")
    if args.record:
        from quasar_hf.hf.model_card import record_measurements

        card = record_measurements(path, fidelity_measurements(result, args))
        print(f"recorded the numbers in {path}/config.json and refreshed {card}")
    return 0


def fidelity_measurements(result: dict, args: argparse.Namespace) -> dict:
    """The eval result as QuasarConfig.measured keys (what the model card renders), with its command."""
    scores = result["next_token"]
    argv = [
        "quasar-hf",
        "eval",
        args.model,
        "--reference",
        args.reference,
        "--seq-len",
        str(args.seq_len),
        "--max-windows",
        str(args.max_windows),
        "--dtype",
        args.dtype,
    ]
    argv += ["--text-file", args.text_file] if args.text_file else (["--dataset", args.dataset] if args.dataset else [])
    return {
        "perplexity": scores["perplexity_model"],
        "reference_perplexity": scores["perplexity_reference"],
        "perplexity_ratio": scores["perplexity_ratio"],
        "top1_agreement": scores["top1_agreement"],
        "kl_divergence": scores["mean_kl_nats"],
        "num_tokens": scores["tokens_evaluated"],
        "fidelity_dataset": result["config"]["text_source"],
        "command": " ".join(argv + ["--record"]),
    }


def cmd_demo(args: argparse.Namespace) -> int:
    from quasar_hf.commands.demo import run_demo

    run_demo(max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens, rebuild=args.rebuild)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from quasar_hf.commands.doctor import run_doctor

    return run_doctor()


# ----------------------------------------------------------------------------- parser
def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Declare every subcommand on `subparsers` (shared with `optimum-cli quasar`)."""

    def command(name: str, handler: Callable, help_text: str) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(name, help=help_text, description=help_text)
        parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
        parser.set_defaults(handler=handler, command=name)
        return parser

    model_help = "checkpoint folder, Hub repo id, or 'smollm2' (the embedded SmolLM2-135M-Instruct)"
    quantize = command("quantize", cmd_quantize, "Quantize a causal LM to a Quasar W8A8 verifier and save it")
    quantize.add_argument("model", help=model_help)
    quantize.add_argument("--out", required=True, help="output folder (weights, config, tokenizer, model card)")
    quantize.add_argument("--alpha", type=alpha_value, default="auto", help="SmoothQuant alpha in [0, 1] or 'auto' (default)")
    quantize.add_argument(
        "--calibration-dataset", help="text file (.txt/.json/.jsonl/.parquet) or Hub dataset name; default built-in text"
    )
    quantize.add_argument("--num-samples", type=positive_int, default=32, help="calibration blocks (default 32)")
    quantize.add_argument("--seq-len", type=positive_int, default=512, help="tokens per calibration block (default 512)")
    quantize.add_argument("--draft-layers", type=draft_layers_value, help="layers kept for self-drafting: 'auto' or 0,1,2")
    quantize.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the unquantized parts")
    quantize.add_argument("--push-to-hub", metavar="REPO", help="also push the result to this Hub repo")
    quantize.add_argument("--token", help="Hub token for --push-to-hub (default: the stored login)")
    quantize.add_argument("--private", action="store_true", help="create the Hub repo as private")

    generate = command("generate", cmd_generate, "Generate text with Quasar speculative decoding")
    generate.add_argument("model", help=model_help)
    generate.add_argument("--prompt", required=True, help="the user message (chat template applied when the tokenizer has one)")
    generate.add_argument("--drafter", choices=DRAFTERS, default="ngram", help="draft source (default ngram prompt lookup)")
    generate.add_argument("--assistant", help="draft model for --drafter assistant")
    generate.add_argument("--num-draft-tokens", type=positive_int, default=5, help="tokens drafted per step (default 5)")
    generate.add_argument("--max-new-tokens", type=positive_int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    generate.add_argument("--stream", action="store_true", help="print tokens as they are accepted")
    generate.add_argument("--no-quasar", action="store_true", help="plain generate, for comparison")
    generate.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    generate.add_argument("--dtype", choices=DTYPES, default=None, help="dtype to load the model in (default: its own)")

    export = command("export", cmd_export, "Export a Quasar W8A8 checkpoint for serving engines (vLLM, SGLang)")
    export.add_argument("model", help="a Quasar checkpoint folder (from `quasar-hf quantize`)")
    export.add_argument("--format", choices=("compressed-tensors",), default="compressed-tensors")
    export.add_argument("--out", required=True, help="output folder")
    export.add_argument(
        "--no-fold-prescale", action="store_true", help="refuse layers with an unfolded act_prescale instead of folding it"
    )

    # The benchmark runner owns its options: everything after `bench` goes to it verbatim
    # (prefix_chars="+" keeps argparse from reading its --options here; `bench --help` is the runner's).
    bench = subparsers.add_parser(
        "bench",
        help="Benchmark plain, BF16-verified and W8A8-verified (Quasar) generation; "
        "options of `python -m quasar_hf.bench.runner` (see `quasar-hf bench --help`)",
        add_help=False,
        prefix_chars="+",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=cmd_bench, command="bench", debug=False)

    evaluate = command("eval", cmd_eval, "Perplexity, top-1 agreement and KL of a Quasar model vs its unquantized reference")
    evaluate.add_argument("model", help="the Quasar checkpoint")
    evaluate.add_argument("--reference", required=True, help="the unquantized model: " + model_help)
    source = evaluate.add_mutually_exclusive_group()
    source.add_argument("--text-file", help="held-out text file (default: built-in held-out text)")
    source.add_argument("--dataset", help="datasets name or local data file loader, e.g. 'wikitext' or 'json'")
    evaluate.add_argument("--split", default="test")
    evaluate.add_argument("--text-column", default="text")
    evaluate.add_argument("--seq-len", type=positive_int, default=256)
    evaluate.add_argument("--max-windows", type=positive_int, default=16)
    evaluate.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the reference model")
    evaluate.add_argument("--json", help="also write the full result as JSON here")
    evaluate.add_argument(
        "--record",
        action="store_true",
        help="write the numbers into MODEL's config (quantization_config.measured) and refresh its model card",
    )

    demo = command("demo", cmd_demo, "Quantize the embedded SmolLM2-135M-Instruct and compare generation with and without Quasar")
    demo.add_argument("--max-new-tokens", type=positive_int, default=128)
    demo.add_argument("--num-draft-tokens", type=positive_int, default=5)
    demo.add_argument("--rebuild", action="store_true", help="re-quantize even if the cached checkpoint exists")

    command("doctor", cmd_doctor, "Print the kernel backends, which are usable here and why not, and library versions")


def build_parser(prog: str = "quasar-hf") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Quasar: W8A8-verified speculative decoding for Transformers.")
    add_subcommands(parser.add_subparsers(dest="command", metavar="COMMAND"))
    return parser


def run_parsed(args: argparse.Namespace, prog: str = "quasar-hf") -> int:
    """Run a parsed subcommand with the exit-code and one-line-error conventions."""
    if "--debug" in getattr(args, "bench_args", ()):
        args.debug = True
    try:
        return int(args.handler(args) or 0)
    except UsageError as error:
        failure, code, message = error, 2, str(error)
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # a runtime failure: one line, traceback only with --debug
        failure, code, message = error, 1, f"{type(error).__name__}: {error}".splitlines()[0]
    if getattr(args, "debug", False):
        traceback.print_exception(failure)
    print(f"{prog} {args.command}: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help(sys.stderr)
        return 2
    return run_parsed(args)


if __name__ == "__main__":
    sys.exit(main())
