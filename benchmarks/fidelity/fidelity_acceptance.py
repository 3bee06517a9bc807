"""W8A8 vs BF16 (and both vs FP32) fidelity on held-out text plus the acceptance comparison; writes reports.

python -m benchmarks fidelity-acceptance --out benchmarks --name fidelity_cpu
"""

from __future__ import annotations

import argparse
import copy
import shlex
import sys

import torch

from benchmarks import reports_dir
from quasar_hf.bench.fidelity import compare_acceptance, compare_next_token, evaluate_fidelity, heldout_texts, token_windows


def main(argv: list[str] | None = None) -> list[str]:
    """CLI: W8A8 vs BF16 (and BF16 vs FP32, for scale) on held-out text + L comparison; write reports."""
    from quasar_hf.bench.report import write_reports
    from quasar_hf.bench.runner import load_bench_models
    from quasar_hf.bench.suites import load_suites, render_prompt

    parser = argparse.ArgumentParser(prog="python -m benchmarks fidelity-acceptance", description=main.__doc__)
    parser.add_argument("--model", default=None, help="checkpoint (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--quantized", default=None, help="saved Quasar checkpoint (default: quantize now)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-windows", type=int, default=16)
    parser.add_argument("--suites", default="all")
    parser.add_argument("--limit-per-suite", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--skip-fp32", action="store_true", help="skip the BF16/W8A8 vs FP32 comparison")
    parser.add_argument("--out", default=reports_dir("fidelity-acceptance"))
    parser.add_argument("--name", default="fidelity_cpu")
    args = parser.parse_args(argv)
    command = "python -m benchmarks fidelity-acceptance " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    reference, quantized, tokenizer, info = load_bench_models(args.model, args.quantized)
    prompts = [torch.tensor([render_prompt(it, tokenizer)]) for it in load_suites(args.suites, args.limit_per_suite)]
    result = {
        "command": command,
        "models": info,
        "fidelity": evaluate_fidelity(quantized, reference, tokenizer, None, seq_len=args.seq_len, max_windows=args.max_windows),
    }
    write = lambda: write_reports(result, args.out, args.name, title="quasar_hf fidelity: W8A8 vs unquantized")  # noqa: E731
    write()  # partial results first: the acceptance comparison is the slow part
    if not args.skip_fp32:
        fp32 = copy.deepcopy(reference).float()
        windows = token_windows(tokenizer, heldout_texts(), args.seq_len, args.max_windows)
        result["bf16_vs_fp32"] = compare_next_token(reference, fp32, windows)
        result["w8a8_vs_fp32"] = compare_next_token(quantized, fp32, windows)
        del fp32
        write()
    result["fidelity"]["acceptance"] = compare_acceptance(quantized, reference, prompts, args.max_new_tokens)
    return write()


if __name__ == "__main__":
    for path in main():
        print(path)
