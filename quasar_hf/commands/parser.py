"""The `quasar-hf` argument parser, shared by the console script and `optimum-cli quasar`.

Exit codes: 0 ok, 1 runtime failure, 2 usage error. Errors print as one line
(`quasar-hf <command>: error: ...`); `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

from quasar_hf.commands.handlers import (
    cmd_bench,
    cmd_demo,
    cmd_doctor,
    cmd_eval,
    cmd_export,
    cmd_generate,
    cmd_mark,
    cmd_quantize,
    cmd_serve,
)
from quasar_hf.commands.loading import DTYPES, UsageError

DRAFTERS = ("auto", "ngram", "assistant", "self")
OVERWRITE_HELP = "write into a non-empty --out folder that holds something else (never the input folder)"


def rotate_value(text: str) -> list[str]:
    """--rotate: comma-separated linear names among down_proj, o_proj, or 'none'."""
    from quasar_hf.hf.config import ROTATABLE

    names = [] if text.strip() == "none" else [n.strip() for n in text.split(",") if n.strip()]
    wrong = [n for n in names if n not in ROTATABLE]
    if wrong or not (names or text.strip() == "none"):
        raise argparse.ArgumentTypeError(f"--rotate takes 'none' or names from {','.join(ROTATABLE)}; got {text!r}")
    return names


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


def _number(text: str, kind: type, what: str, accepts) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not accepts(value):
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "a positive integer", lambda v: v >= 1)


def positive_float(text: str) -> float:
    return _number(text, float, "a positive number", lambda v: v > 0)


def non_negative_float(text: str) -> float:
    return _number(text, float, "a number >= 0", lambda v: v >= 0)


def draft_layers_value(text: str) -> list[int] | str:
    """--draft-layers: 'auto' or comma-separated layer indices."""
    if text == "auto":
        return text
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"draft layers must be 'auto' or indices like 0,1,2; got {text!r}") from None


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
    quantize.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    quantize.add_argument("--alpha", type=alpha_value, default="auto", help="SmoothQuant alpha in [0, 1] or 'auto' (default)")
    quantize.add_argument(
        "--calibration-dataset", help="text file (.txt/.json/.jsonl/.parquet) or Hub dataset name; default built-in text"
    )
    quantize.add_argument(
        "--text-column", help="column holding the text in a .json/.jsonl/.parquet/.csv or Hub calibration dataset"
    )
    quantize.add_argument(
        "--rotate",
        type=rotate_value,
        default=None,
        help="linears whose input is Hadamard-rotated: 'down_proj' (default), 'down_proj,o_proj', or 'none'",
    )
    quantize.add_argument(
        "--weight-rounding", choices=("gptq", "nearest"), default=None, help="int8 weight rounding (default gptq)"
    )
    quantize.add_argument("--num-samples", type=positive_int, default=32, help="calibration blocks (default 32)")
    quantize.add_argument("--seq-len", type=positive_int, default=512, help="tokens per calibration block (default 512)")
    quantize.add_argument("--draft-layers", type=draft_layers_value, help="layers kept for self-drafting: 'auto' or 0,1,2")
    quantize.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the unquantized parts")
    quantize.add_argument(
        "--calibration-dtype",
        choices=("auto", "model", "float32"),
        default=None,
        help="what calibration computes in (default auto: float32 on a CPU without native bf16)",
    )
    quantize.add_argument(
        "--calibration-device",
        default=None,
        help="where each layer is calibrated: auto (a GPU when torch sees one, default), cpu, or e.g. cuda:1",
    )
    quantize.add_argument("--profile", action="store_true", help="print where the quantization time went, by phase")
    quantize.add_argument("--push-to-hub", metavar="REPO", help="also push the result to this Hub repo")
    quantize.add_argument("--token", help="Hub token for --push-to-hub (default: the stored login)")
    quantize.add_argument("--private", action="store_true", help="create the Hub repo as private")

    generate = command("generate", cmd_generate, "Generate text with Quasar speculative decoding")
    generate.add_argument("model", help=model_help)
    generate.add_argument("--prompt", required=True, help="the user message (chat template applied when the tokenizer has one)")
    generate.add_argument(
        "--drafter",
        choices=DRAFTERS,
        default="auto",
        help="draft source: auto (default: n-gram drafts verified as far as they pay), ngram (always verified whole)",
    )
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
    export.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    export.add_argument(
        "--no-fold-prescale", action="store_true", help="refuse layers with an unfolded act_prescale instead of folding it"
    )

    mark = command(
        "mark",
        cmd_mark,
        "Mark a Quasar checkpoint saved by an older quasar_hf, so that Transformers without quasar_hf refuses it",
    )
    mark.add_argument("model", help="a local Quasar checkpoint folder (rewrites its config.json; the weights stay)")

    # The benchmark runner owns its options: everything after `bench` goes to it verbatim
    # (prefix_chars="+" keeps argparse from reading its --options here; `bench --help` is the runner's).
    bench = subparsers.add_parser(
        "bench",
        help="Benchmark plain, BF16-verified and W8A8-verified (Quasar) generation; (its options: `quasar-hf bench --help`)",
        add_help=False,
        prefix_chars="+",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=cmd_bench, command="bench", debug=False)

    evaluate = command(
        "eval",
        cmd_eval,
        "Perplexity, top-1 agreement and KL of a Quasar model vs its unquantized reference; "
        "`eval MODEL --tasks a,b` runs lm-eval tasks instead (see `quasar-hf eval --tasks x --help`)",
    )
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

    doctor = command(
        "doctor",
        cmd_doctor,
        "Print the kernel backends, which are usable here and why not, library versions, and whether compiled steps work",
    )
    doctor.add_argument("--no-compile-check", action="store_true", help="skip compiling a small step (a few seconds)")

    serve = command(
        "serve",
        cmd_serve,
        "Serve a model through Transformers' OpenAI-compatible server, decoded with Quasar, concurrent clients batched",
    )
    serve.add_argument("model", help="a Quasar checkpoint, or a model to quantize once and cache: " + model_help)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)"
    )
    serve.add_argument("--port", type=positive_int, default=8000)
    serve.add_argument("--compile", action="store_true", help="compiled steps, compiled and warmed up before the server listens")
    serve.add_argument(
        "--max-batch-size", type=positive_int, default=8, help="requests decoded together in one batch (default 8)"
    )
    serve.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="prompt plus new tokens per request (default: the model's context; with --compile 4090, what the compiled cache of 4096 slots holds)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every request but /health (default: $QUASAR_HF_API_KEY; none)",
    )
    serve.add_argument(
        "--max-queued",
        type=positive_int,
        default=None,
        help="requests waiting past this get 429 with Retry-After (default: no limit)",
    )
    serve.add_argument(
        "--request-timeout",
        type=positive_float,
        default=None,
        help="seconds a request may take; then it ends with its tokens so far, finish_reason 'length' (default: none)",
    )
    serve.add_argument(
        "--prompt-cache-gb",
        type=non_negative_float,
        default=None,
        help="host memory for the keys and values of finished requests, reused by requests that share their prefix "
        "(default: a tenth of the machine's memory, at most 8; 0: off)",
    )
    serve.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the checkpoint's own Python code to run (off: only Transformers' and quasar_hf's model classes load)",
    )
    serve.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    serve.add_argument(
        "--drafter",
        choices=("auto", "ngram"),
        default="auto",
        help="auto (default): n-gram drafts paused while they do not pay (batches, open-ended chat); ngram: always draft",
    )


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


def run_delegated(entry: Callable[[list[str]], int], argv: list[str], command: str, prog: str = "quasar-hf") -> int:
    """Run a delegated entry point (`eval --tasks ...`) with `run_parsed`'s exit codes and one-line errors."""
    debug = "--debug" in argv
    try:
        return int(entry([arg for arg in argv if arg != "--debug"]) or 0)
    except UsageError as error:
        failure, code, message = error, 2, str(error)
    except KeyboardInterrupt:
        return 130
    except SystemExit:  # argparse's own usage errors (already printed, exit code 2) and --help
        raise
    except Exception as error:  # a runtime failure: one line, traceback only with --debug
        failure, code, message = error, 1, f"{type(error).__name__}: {error}".splitlines()[0]
    if debug:
        traceback.print_exception(failure)
    print(f"{prog} {command}: error: {message}", file=sys.stderr)
    return code


def _lm_eval_main(argv: list[str]) -> int:
    from quasar_hf.eval import eval_main

    return eval_main(argv)


# `eval` modes with options of their own: the first flag present picks the entry point.
_EVAL_MODES = {"--tasks": _lm_eval_main}


def delegated_eval(argv: list[str]) -> Callable[[list[str]], int] | None:
    """The entry point that owns `argv` when it is `eval ... --tasks ...` (or another eval mode), else None."""
    if not argv or argv[0] != "eval":
        return None
    for flag, entry in _EVAL_MODES.items():
        if any(arg == flag or arg.startswith(flag + "=") for arg in argv[1:]):
            return entry
    return None
