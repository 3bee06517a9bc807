"""Serve the compressed-tensors export in vLLM and compare its greedy output with Transformers'.

    python -m benchmarks vllm-check --checkpoint QUASAR_DIR --out DIR     # CUDA machine with vLLM
    python -m benchmarks vllm-check --tiny --out DIR                      # anywhere: export + skip report

Steps: load the Quasar W8A8 checkpoint, export it (`quasar_hf.export.export_compressed_tensors`),
greedy-decode the prompts with Transformers on the Quasar model (`generate(quasar=...)`, n-gram
drafts), then, where vLLM imports and CUDA is present, with vLLM on the export, without and with
its n-gram speculator. Writes DIR/vllm_check.json and .md.

What "equal" can mean here: vLLM runs its own int8 kernels (activation scales amax/127 as ours,
different accumulation order and attention), so its tokens may leave ours at a near-tie; the
report gives, per prompt, the first position where they differ. vLLM with and without its n-gram
speculator must agree with each other (its speculative decoding is exact for greedy).
Where vLLM or CUDA is missing, the export still runs and the report says why serving was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

PROMPTS = (
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday.",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    "List three uses of a hash map, one line each.",
)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Per-prompt first difference and the share of prompts with identical tokens."""
    firsts = [first_difference(r, o) for r, o in zip(reference, other)]
    return {"identical_prompts": sum(f is None for f in firsts), "prompts": len(firsts), "first_difference": firsts}


def vllm_unavailable_reason() -> str | None:
    """Why vLLM cannot run here, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import vllm  # noqa: F401
    except Exception as error:  # not installed, or installed for another torch/CUDA
        return f"vllm does not import ({type(error).__name__}: {error})"
    return None


def transformers_greedy(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
        seq = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, quasar={"drafter": "ngram"})
        out.append(seq[0, ids.shape[1] :].tolist())
    return out


def vllm_greedy(export_dir: str, prompts: list[str], max_new_tokens: int, speculative: bool) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(
        model=export_dir,
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        speculative_config=spec if speculative else None,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)  # stops at EOS, as generate does
    results = llm.generate(list(prompts), params)
    del llm
    return [list(r.outputs[0].token_ids) for r in results]


def load_checkpoint(args: argparse.Namespace, workdir: str):
    """(Quasar model, tokenizer): --checkpoint, or a tiny model quantized now (--tiny)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quasar_hf  # noqa: F401  (registers quant_method "quasar")
    from quasar_hf import QuasarConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        from tests.tiny_models import save_tiny

        source = save_tiny(os.path.join(workdir, "tiny"))
        config = QuasarConfig(num_calibration_samples=2, calibration_seq_len=32, weight_rounding="nearest", rotate=[])
        model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.float32)
        return model.to(device).eval(), AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16, device_map=device)
    return model.eval(), AutoTokenizer.from_pretrained(args.checkpoint)


def run(args: argparse.Namespace) -> dict:
    from quasar_hf.bench.report import environment
    from quasar_hf.export import export_compressed_tensors

    result: dict = {"environment": environment(), "prompts": list(PROMPTS), "max_new_tokens": args.max_new_tokens}
    with tempfile.TemporaryDirectory() as workdir:
        model, tokenizer = load_checkpoint(args, workdir)
        export_dir = os.path.join(workdir, "export")
        report = export_compressed_tensors(model, export_dir, tokenizer=tokenizer)
        result["export"] = {"quantized_modules": len(report.quantized_modules), "max_fold_rel_error": report.max_fold_rel_error}
        ours = transformers_greedy(model, tokenizer, list(PROMPTS), args.max_new_tokens)
        result["transformers_quasar_tokens"] = ours
        reason = vllm_unavailable_reason()
        if reason is not None:
            result["vllm"] = {"skipped": reason}
            return result
        import vllm

        del model
        torch.cuda.empty_cache()
        plain = vllm_greedy(export_dir, list(PROMPTS), args.max_new_tokens, speculative=False)
        spec = vllm_greedy(export_dir, list(PROMPTS), args.max_new_tokens, speculative=True)
        result["vllm"] = {
            "version": vllm.__version__,
            "plain_vs_transformers": compare(ours, plain),
            "ngram_vs_plain": compare(plain, spec),
            "tokens_plain": plain,
        }
    return result


def to_markdown(result: dict) -> str:
    lines = ["# vLLM load check of the compressed-tensors export", ""]
    lines += [f"- export: {result['export']}"]
    info = result["vllm"]
    if "skipped" in info:
        lines += [f"- vLLM serving skipped: {info['skipped']}"]
    else:
        lines += [
            f"- vLLM {info['version']}, greedy, {result['max_new_tokens']} new tokens, {len(result['prompts'])} prompts",
            f"- vLLM vs Transformers (Quasar W8A8): {info['plain_vs_transformers']}",
            f"- vLLM n-gram speculation vs vLLM plain: {info['ngram_vs_plain']}",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="a saved Quasar W8A8 checkpoint folder")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model quantized now (mechanics only)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not args.tiny and not args.checkpoint:
        parser.error("pass --checkpoint QUASAR_DIR (or --tiny for a mechanics run)")
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vllm_check.json"), "w") as handle:
        json.dump(result, handle, indent=1, default=str)
    with open(os.path.join(args.out, "vllm_check.md"), "w") as handle:
        handle.write(to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
