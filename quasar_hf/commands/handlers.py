"""The `quasar-hf` subcommands: one function per command, taking the parsed arguments.

Heavy imports (torch, Transformers) happen inside each function so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from quasar_hf.commands.loading import UsageError


def cmd_quantize(args: argparse.Namespace) -> int:
    from quasar_hf.commands.loading import (
        is_quasar_checkpoint,
        load_tokenizer,
        quantize_checkpoint,
        resolve_model,
        save_quantized,
    )
    from quasar_hf.commands.output_dir import check_output_dir

    path = resolve_model(args.model)
    if is_quasar_checkpoint(path):
        raise UsageError(
            f"{args.model} is already a Quasar W8A8 checkpoint; quantize its original (unquantized) model instead, "
            "or copy the folder to keep a second copy"
        )
    check_output_dir(args.out, path, "quasar", overwrite=args.overwrite)  # before the (long) quantization
    options = {"alpha": args.alpha, "num_calibration_samples": args.num_samples, "calibration_seq_len": args.seq_len}
    if args.calibration_dataset is not None:
        options["calibration_dataset"] = args.calibration_dataset
    if args.text_column is not None:
        options["calibration_text_column"] = args.text_column
    if args.draft_layers is not None:
        options["draft_layers"] = args.draft_layers
    if args.rotate is not None:
        options["rotate"] = args.rotate
    if args.weight_rounding is not None:
        options["weight_rounding"] = args.weight_rounding
    if args.calibration_dtype is not None:
        options["calibration_dtype"] = args.calibration_dtype
    if args.calibration_device is not None:
        options["calibration_device"] = args.calibration_device
    state = resume_folder(args.out)
    options["resume_dir"] = state
    print(
        f"quantizing {args.model}; its progress is saved after every layer in {state}: if this run stops, run the "
        "same command again to continue from the last finished layer",
        flush=True,
    )
    start = time.perf_counter()
    try:
        model = quantize_checkpoint(path, options, args.dtype)
    except BaseException:  # a failure, Ctrl-C, or an out-of-memory error: say where to pick up
        done = _finished_layers(state)
        if done:
            print(f"stopped after {done} finished decoder layers; run the same command again to resume", file=sys.stderr)
        raise
    tokenizer = load_tokenizer(path)
    try:
        save_quantized(model, tokenizer, args.out)
    except BaseException:  # a full disk, say: the finished layers stay, so a rerun only saves
        print(
            f"saving to {args.out} failed; every quantized layer is kept in {state}: fix the cause (free disk "
            f"space) and run the same command again to save without recalibrating, or delete {state}",
            file=sys.stderr,
        )
        raise
    shutil.rmtree(state, ignore_errors=True)  # saved: the state is not needed any more
    qconfig = model.config.quantization_config
    count = len(getattr(qconfig, "quantized_modules", None) or [])
    print(f"quantized {count} linear layers to W8A8 in {time.perf_counter() - start:.1f} s; saved to {args.out}")
    info = getattr(qconfig, "calibration_info", None) or {}
    if info.get("math_dtype"):
        print(f"calibration computed in {info['math_dtype']} ({info.get('math_dtype_reason', '')})")
    if args.profile and info.get("timing"):
        from quasar_hf.smoothquant.phase_times import format_timing

        print(format_timing(info["timing"]))
    if args.push_to_hub:
        from quasar_hf.hub.push import push_quasar_model

        commit = push_quasar_model(model, args.push_to_hub, tokenizer=tokenizer, token=args.token, private=args.private)
        print(f"pushed to {commit.commit_url}")
    return 0


def _finished_layers(state: str) -> int:
    try:
        with open(os.path.join(state, "progress.json")) as f:
            return int(json.load(f).get("next_layer", 0))
    except (OSError, ValueError):
        return 0


def resume_folder(out: str) -> str:
    """Where `quantize --out OUT` keeps its per-layer state: OUT.partial beside the output."""
    return os.path.abspath(out).rstrip(os.sep) + ".partial"


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
    from quasar_hf.commands.output_dir import check_output_dir
    from quasar_hf.export.compressed_tensors import export_compressed_tensors

    path = resolve_model(args.model)
    if not is_quasar_checkpoint(path):
        raise UsageError(f"{args.model} is not a Quasar W8A8 checkpoint; run `quasar-hf quantize {args.model} --out DIR` first")
    check_output_dir(args.out, path, "compressed-tensors", overwrite=args.overwrite)
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
    if report.rotated_modules:
        print(
            f"{len(report.rotated_modules)} linears take a Hadamard-rotated input, written as a compressed-tensors "
            "input transform (quantization_config.transform_config). vLLM applies it; on vLLM's CPU backend "
            "install quasar-hf beside vLLM (its plugin lets that backend run transforms); Transformers' "
            "compressed-tensors loader ignores transforms, so load the Quasar checkpoint there (docs/serving.md)"
        )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Pass every option through to the benchmark runner (`quasar_hf.bench.runner.bench_main`)."""
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
        from quasar_hf.hub.model_card import record_measurements

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


def cmd_serve(args: argparse.Namespace) -> int:
    from quasar_hf.commands.serve import run_serve

    return run_serve(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    from quasar_hf.commands.doctor import run_doctor

    return run_doctor(check_compile=not args.no_compile_check)


def cmd_mark(args: argparse.Namespace) -> int:
    from pathlib import Path

    from quasar_hf.hf.checkpoint_config import is_marked, mark_checkpoint

    folder = Path(args.model)
    if not (folder / "config.json").is_file():
        raise UsageError(f"{args.model} is not a local checkpoint folder (no config.json)")
    if is_marked(folder):
        print(f"{folder} is already marked: nothing changed")
        return 0
    try:
        mark_checkpoint(folder)
    except ValueError as error:
        raise UsageError(f"{args.model}: {error}") from None
    print(f"marked {folder}: config.json says model_type quasar_hf; Transformers without quasar_hf now refuses it")
    return 0
