"""Interleaved generation benchmark: every variant on the same prompts, machine and run.

Variants (names are stable, they key the JSON report):
  bf16_generate       plain greedy `generate` on the unquantized model
  bf16_prompt_lookup  Transformers' prompt lookup decoding on the unquantized model
  bf16_verify_ngram   the speculative loop, n-gram drafts, verified by the unquantized model
  quasar_ngram        the same loop verified by the W8A8 model (the method)
  quasar_<drafter>    the W8A8 model with another drafter of `quasar_hf.speculative`, when present
  w8a8_generate       plain greedy `generate` on the W8A8 model (what quasar_* must reproduce)
  w8a8_compiled       the same through the compiled steps (`quasar={"compile": True, "num_draft_tokens": 0}`)
  quasar_ngram_compiled  `quasar={"compile": True}` (must reproduce w8a8_compiled); compiled variants
                      warm up on every prompt, so no compile time falls in a timed run
  ao_w8a8, ...        peers a user would run instead (`quasar_hf.bench.peers`), when installed

Variants are interleaved (repeat -> prompt -> rotated variant order) so that slow drift of a shared
machine spreads evenly. The headline is every variant's median tokens/s divided by
bf16_verify_ngram's. Greedy decoding throughout: every speculative variant must emit the tokens of
its own model's plain greedy decoding, which the report checks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from quasar_hf.bench.fidelity import speculative_tokens
from quasar_hf.bench.peers import PLAIN_BASELINE, build_peer_variants, mark_peer_exactness
from quasar_hf.bench.suites import load_suites, render_prompt
from quasar_hf.bench.summary import (  # re-exported: part of the runner's result API
    BASELINE,
    acceptance_length_ratio,
    headline_ratios,
    mark_token_agreement,
    summarize_variant,
)
from quasar_hf.bench.timing import timed
from quasar_hf.bench.variants import Generate, greedy_generate
from quasar_hf.speculative.verify_attention import rowstable_attention_for

DEFAULT_VARIANTS = ("bf16_generate", "bf16_prompt_lookup", "bf16_verify_ngram", "quasar_ngram")
COMPILED_VARIANTS = {  # name -> the `quasar=` option of model.generate
    "w8a8_compiled": {"compile": True, "num_draft_tokens": 0},
    "quasar_ngram_compiled": {"compile": True},
}


# ---------------------------------------------------------------- peak memory
class PeakMemory:
    """Peak memory during a block: torch.cuda.max_memory_allocated on CUDA, else peak RSS (VmHWM).

    On Linux the RSS high-water mark is reset by writing "5" to /proc/self/clear_refs; where that
    is not allowed the process-lifetime peak is reported (`peak_bytes` is None off Linux).
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.peak_bytes: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.startswith("cuda"):
            self.peak_bytes = int(torch.cuda.max_memory_allocated())
            return
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        self.peak_bytes = int(line.split()[1]) * 1024
        except OSError:
            self.peak_bytes = None


def _speculative(model: torch.nn.Module, drafter: str, num_draft_tokens: int) -> Generate:
    """A variant running the speculative loop with `model` as the verifier.

    Both verifiers run the same attention (the row-stable kernel Quasar models carry; an SDPA
    model is switched for the call only), so BF16-verify vs W8A8-verify differ in the linears alone.
    """

    def run(input_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], dict]:
        with rowstable_attention_for(model):
            return speculative_tokens(model, input_ids, max_new_tokens, drafter, num_draft_tokens)

    return run


def build_variants(
    names: tuple[str, ...] | list[str],
    reference_model: torch.nn.Module,
    quantized_model: torch.nn.Module | None,
    num_draft_tokens: int = 5,
    gguf: str | None = None,
) -> dict[str, Generate]:
    """Map variant names to generate functions; unknown names raise with the list of known ones."""
    variants: dict[str, Generate] = build_peer_variants(names, reference_model, num_draft_tokens, gguf)
    for name in [n for n in names if n not in variants]:
        if name == "bf16_generate":
            variants[name] = greedy_generate(reference_model)
        elif name == "bf16_prompt_lookup":
            variants[name] = greedy_generate(
                reference_model, prompt_lookup_num_tokens=num_draft_tokens, max_matching_ngram_size=3
            )
        elif name == "w8a8_generate":
            if quantized_model is None:
                raise ValueError("variant 'w8a8_generate' needs a quantized_model (a W8A8 copy of the model)")
            variants[name] = greedy_generate(quantized_model)
        elif name in COMPILED_VARIANTS:
            if quantized_model is None:
                raise ValueError(f"variant {name!r} needs a quantized_model (a W8A8 copy of the model)")
            variants[name] = greedy_generate(quantized_model, quasar=COMPILED_VARIANTS[name])
        elif name == "bf16_verify_ngram":
            variants[name] = _speculative(reference_model, "ngram", num_draft_tokens)
        elif name.startswith("quasar_"):
            if quantized_model is None:
                raise ValueError(f"variant {name!r} needs a quantized_model (a W8A8 copy of the model)")
            variants[name] = _speculative(quantized_model, name.removeprefix("quasar_"), num_draft_tokens)
        else:
            raise ValueError(
                f"unknown variant {name!r}: use bf16_generate, bf16_prompt_lookup, bf16_verify_ngram, w8a8_generate, "
                f"quasar_<drafter>, {', '.join(COMPILED_VARIANTS)} "
                f"or a peer ({', '.join(PLAIN_BASELINE)})"
            )
    return variants


def _probe_variants(generators: dict[str, Generate], input_ids: torch.Tensor) -> dict[str, str]:
    """Run each variant for 2 tokens; those that raise (e.g. a drafter not built yet) are reported, not run."""
    failed = {}
    for name, generate in generators.items():
        try:
            generate(input_ids, 2)
        except Exception as err:  # a broken optional variant must not sink the whole benchmark
            failed[name] = f"{type(err).__name__}: {err}"
    return failed


def _interleaved_order(names: list[str], step: int) -> list[str]:
    """Rotate the variant order by `step` so no variant always runs first (or right after another)."""
    shift = step % len(names)
    return names[shift:] + names[:shift]


def _time_one(generate: Generate, input_ids: torch.Tensor, max_new_tokens: int, device: str) -> dict:
    """Run one generation; wall time (synchronized on CUDA), tokens, stats and peak memory."""
    with PeakMemory(device) as memory:
        (tokens, stats), seconds = timed(lambda: generate(input_ids, max_new_tokens), device)
    return {"tokens": tokens, "seconds": seconds, "stats": stats, "peak_memory_bytes": memory.peak_bytes}


def run_bench(
    reference_model: torch.nn.Module,
    quantized_model: torch.nn.Module | None,
    tokenizer: Any,
    *,
    suites: str | list[str] = "all",
    limit_per_suite: int | None = None,
    prompts: list[dict] | None = None,
    variants: tuple[str, ...] | list[str] = DEFAULT_VARIANTS,
    max_new_tokens: int = 64,
    repeats: int = 3,
    warmup: int = 1,
    num_draft_tokens: int = 5,
    log: Callable[[str], None] | None = None,
    gguf: str | None = None,
) -> dict:
    """Benchmark generation variants, interleaved, on the same prompts; return a result dict.

    reference_model: the unquantized (BF16) model; quantized_model: its W8A8 copy (None skips the
    quasar_* variants). prompts: suite items (see `suites.load_suite`), default `suites` loaded
    with `limit_per_suite`. Each (prompt, variant) runs `warmup` untimed then `repeats` timed times.
    Returns {"config", "variants": {name: summary}, "headline": {name: speedup vs bf16_verify_ngram},
    "runs": [...]}; feed it to `report.write_reports`.
    """
    if repeats < 1 or warmup < 0 or max_new_tokens < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0, max_new_tokens >= 1; got {repeats}, {warmup}, {max_new_tokens}")
    items = prompts if prompts is not None else load_suites(suites, limit_per_suite)
    if not items:
        raise ValueError("no prompts to benchmark: pass prompts=[...] or a non-empty suite")
    if quantized_model is None:
        variants = [v for v in variants if not v.startswith("quasar_") and not v.startswith("w8a8_")]
    names = list(variants)
    generators = build_variants(names, reference_model, quantized_model, num_draft_tokens, gguf)
    device = str(next(reference_model.parameters()).device)
    encoded = [torch.tensor([render_prompt(item, tokenizer)], device=device) for item in items]
    say = log or (lambda message: None)

    unavailable = _probe_variants(generators, encoded[0])
    names = [n for n in names if n not in unavailable]
    if not names:
        raise RuntimeError(f"every variant failed on the first prompt: {unavailable}")
    for _ in range(warmup):
        for name in names:
            for input_ids in encoded if name in COMPILED_VARIANTS else encoded[:1]:  # each shape compiles once
                generators[name](input_ids, max_new_tokens)
    runs: list[dict] = []
    step = 0
    for repeat in range(repeats):
        for index, (item, input_ids) in enumerate(zip(items, encoded)):
            for name in _interleaved_order(names, step):
                run = _time_one(generators[name], input_ids, max_new_tokens, device)
                run.update(variant=name, repeat=repeat, prompt_index=index, prompt_id=item["id"], suite=item["suite"])
                runs.append(run)
            step += 1
        say(f"repeat {repeat + 1}/{repeats} done")
    summaries = {name: summarize_variant([r for r in runs if r["variant"] == name]) for name in names}
    mark_token_agreement(summaries, runs)
    mark_peer_exactness(summaries, runs)
    if BASELINE in names:
        for name in names:
            if name.startswith("quasar_"):
                summaries[name]["L_ratio_vs_baseline"] = acceptance_length_ratio(runs, name)
    return {
        "config": {
            "variants": names,
            "prompts": [{"id": it["id"], "suite": it["suite"], "version": it["version"]} for it in items],
            "prompt_tokens": [int(ids.shape[1]) for ids in encoded],
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "warmup": warmup,
            "num_draft_tokens": num_draft_tokens,
            "gguf": gguf,
            "device": device,
            "interleaving": "repeat -> prompt -> variant order rotated by one each prompt",
        },
        "variants": summaries,
        "unavailable_variants": unavailable,
        "headline": headline_ratios(summaries),
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
    }


# ---------------------------------------------------------------- end to end (CLI level)
def available_quasar_variants() -> list[str]:
    """quasar_<drafter> for every drafter that needs no extra model ("assistant" needs one: skipped)."""
    from quasar_hf.speculative import DRAFTER_FACTORIES

    return [f"quasar_{name}" for name in DRAFTER_FACTORIES if name != "assistant"]


def load_bench_models(
    model_path: str | None = None,
    quantized_path: str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    quantization_config: Any = None,
) -> tuple[torch.nn.Module, torch.nn.Module, Any, dict]:
    """(reference BF16 model, W8A8 model, tokenizer, info) for the benchmark.

    model_path None = the embedded SmolLM2-135M-Instruct. The W8A8 model is loaded from
    `quantized_path` (a saved Quasar checkpoint) or quantized now with `quantization_config`
    (default QuasarConfig()), which calibrates on the built-in calibration split.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quasar_hf  # noqa: F401  (registers quant_method "quasar")
    from quasar_hf import QuasarConfig

    if model_path is None:
        from quasar_hf.models import smollm2_135m_instruct

        model_path = smollm2_135m_instruct()
    else:
        from quasar_hf.commands.loading import resolve_model

        model_path = resolve_model(model_path)  # a missing folder is a one-line usage error, not a Hub lookup
    if quantized_path is not None:
        from quasar_hf.commands.loading import resolve_model

        quantized_path = resolve_model(quantized_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    start = time.perf_counter()
    if quantized_path is not None:
        quantized = AutoModelForCausalLM.from_pretrained(quantized_path, dtype=dtype).eval()
    else:
        config = quantization_config or QuasarConfig()
        quantized = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=config, dtype=dtype).eval()
    info = {
        "model": str(model_path),
        "quantized_from": str(quantized_path or "quantized at run time"),
        "quantize_or_load_s": time.perf_counter() - start,
        "dtype": str(dtype),
    }
    qconfig = getattr(quantized.config, "quantization_config", None)
    if qconfig is not None:
        qdict = qconfig if isinstance(qconfig, dict) else qconfig.to_dict()
        info["quantization"] = {k: qdict.get(k) for k in ("alpha", "backend", "calibration_info", "searched_alphas")}
    return reference, quantized, tokenizer, info


def quantization_config_from_args(args: Any) -> Any:
    """QuasarConfig from --alpha / --calibration-samples / --calibration-seq-len (None: the defaults)."""
    from quasar_hf import QuasarConfig

    overrides = {}
    if args.alpha is not None:
        overrides["alpha"] = args.alpha if args.alpha == "auto" else float(args.alpha)
    if args.calibration_samples is not None:
        overrides["num_calibration_samples"] = args.calibration_samples
    if args.calibration_seq_len is not None:
        overrides["calibration_seq_len"] = args.calibration_seq_len
    return QuasarConfig(**overrides) if overrides else None


def _parse_args(argv: list[str] | None) -> Any:
    import argparse

    parser = argparse.ArgumentParser(prog="quasar-hf bench", description=bench_main.__doc__)
    parser.add_argument("--model", default=None, help="checkpoint dir or Hub id (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--quantized", default=None, help="a saved Quasar W8A8 checkpoint (default: quantize now)")
    parser.add_argument("--alpha", default=None, help='SmoothQuant alpha when quantizing now (float or "auto")')
    parser.add_argument("--calibration-samples", type=int, default=None, help="calibration blocks when quantizing now")
    parser.add_argument("--calibration-seq-len", type=int, default=None, help="tokens per calibration block")
    parser.add_argument("--save-quantized", default=None, help="save the W8A8 model quantized now into this folder")
    parser.add_argument("--suites", default="all", help='comma-separated suite names or "all"')
    parser.add_argument("--limit-per-suite", type=int, default=None)
    parser.add_argument("--variants", default=None, help="comma-separated variant names (default: all available)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--num-draft-tokens", type=int, default=5)
    parser.add_argument("--fidelity", action="store_true", help="also evaluate fidelity (held-out ppl, top-1, KL, L)")
    parser.add_argument("--gguf", default=None, help="GGUF file of the same checkpoint, for the llamacpp_* peer variants")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--out", default="benchmarks", help="output folder for JSON, markdown and plots")
    parser.add_argument("--name", default="bench_cpu", help="file name stem of the reports")
    return parser.parse_args(argv)


def bench_main(argv: list[str] | None = None) -> list[str]:
    """Quantize (or load) the model, run the interleaved benchmark (+ fidelity), write reports."""
    import shlex
    import sys

    from quasar_hf.bench.report import write_reports

    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    reference, quantized, tokenizer, info = load_bench_models(
        args.model, args.quantized, quantization_config=quantization_config_from_args(args)
    )
    if args.save_quantized:
        quantized.save_pretrained(args.save_quantized)
        tokenizer.save_pretrained(args.save_quantized)
    default_variants = ["bf16_generate", "bf16_prompt_lookup", BASELINE, *available_quasar_variants()]
    variants = args.variants.split(",") if args.variants else default_variants
    result = run_bench(
        reference,
        quantized,
        tokenizer,
        suites=args.suites,
        limit_per_suite=args.limit_per_suite,
        variants=variants,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        num_draft_tokens=args.num_draft_tokens,
        log=lambda m: print(m, file=sys.stderr, flush=True),
        gguf=args.gguf,
    )
    result["models"] = info
    if args.fidelity:
        from quasar_hf.bench.fidelity import evaluate_fidelity
        from quasar_hf.bench.suites import load_suites, render_prompt

        prompts = [torch.tensor([render_prompt(it, tokenizer)]) for it in load_suites(args.suites, args.limit_per_suite)]
        result["fidelity"] = evaluate_fidelity(
            quantized,
            reference,
            tokenizer,
            None,
            acceptance_prompts=prompts,
            max_new_tokens=args.max_new_tokens,
            num_draft_tokens=args.num_draft_tokens,
        )
    result["command"] = "quasar-hf bench " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    return write_reports(result, args.out, args.name, title="quasar_hf generation benchmark")
