"""The default Quasar checkpoint served by vLLM on this CPU, side by side with our own decoding.

    python -m benchmarks vllm-check --out DIR                     # SmolLM2 and Qwen 0.5B, QuasarConfig()
    python -m benchmarks vllm-check --models smollm2 --checkpoint smollm2=QUASAR_DIR --out DIR
    python -m benchmarks vllm-check --tiny --out DIR              # mechanics only: no vLLM

Per model: quantize with `QuasarConfig()` (or take --checkpoint), export to compressed-tensors (the
rotated `down_proj` as an input transform), then
  * ours: plain W8A8 greedy, eager `quasar=True`, compiled `quasar=True` (tokens, seconds);
  * vLLM (its own venv, benchmarks/serve/vllm/make_venv.sh; `worker.py` there): plain greedy with its
    top-2 log-probabilities, n-gram speculation with the Quasar authors' settings (5 tokens,
    prompt lookup 1..3), and `vllm serve` answering `openai` chat requests;
  * per prompt, the first token where vLLM's plain tokens leave ours, and both sides' logit gap
    between the two candidates there. vLLM's int8 kernels round and accumulate in another order,
    so a divergence passes only at a near-tie: our gap <= --near-tie (1 nat by default: the runner-up has at least 1/e of the top
    token's probability). The
    report also gives the gap disagreement at the positions where both agree (the noise floor).
Everything runs in one sitting, one process at a time. Writes DIR/vllm_check.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.serve.vllm_report import first_difference, summarize_model, to_markdown
from quasar_hf.detect import plain_decoding

REPO = Path(__file__).resolve().parents[2]
PROMPTS = (  # input-grounded rewrites: what n-gram drafting is for
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday.",
    "Fix the grammar, keep everything else: 'Me and him goes to the store every days, and we buys bread.'",
    "Convert to a Python list of strings, one per word: the quick brown fox jumps over the lazy dog",
    "Repeat this function with type hints added:\ndef area(width, height):\n    return width * height",
)
MODELS = {"smollm2": "smollm2_135m_instruct", "qwen": "qwen25_coder_05b_instruct"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def vllm_settings() -> dict[str, str]:
    """vLLM's CPU settings (its docs: VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND, reserved
    CPUs). Binding is left to vLLM ("auto"): it keeps one core for its engine-core process, whose
    scheduler polls (docs/serving.md has the one run that gave the worker both cores)."""
    return {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "auto"}


def compare(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Per-prompt first difference and the number of prompts with identical tokens."""
    firsts = [first_difference(r, o) for r, o in zip(reference, other)]
    return {"identical_prompts": sum(f is None for f in firsts), "prompts": len(firsts), "first_difference": firsts}


def prompt_ids(tokenizer) -> list[list[int]]:
    """Each prompt as one user turn under the model's chat template (the ids both sides decode from)."""
    if not tokenizer.chat_template:
        return [tokenizer(p).input_ids for p in PROMPTS]
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


def load_model(name: str, checkpoint: str | None, tiny_dir: str | None) -> tuple[torch.nn.Module, object, dict]:
    """(Quasar model, tokenizer, provenance): a saved checkpoint, or the embedded model quantized now."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quasar_hf
    from quasar_hf import models

    if tiny_dir is not None:
        from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny

        source = make_tiny_checkpoint(Path(tiny_dir) / "tiny")
        return quantize_tiny(source), AutoTokenizer.from_pretrained(source), {"source": "tiny random Llama"}
    if checkpoint is not None:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
        return model, AutoTokenizer.from_pretrained(checkpoint), {"checkpoint": checkpoint}
    source = getattr(models, MODELS[name])()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.bfloat16, quantization_config=quasar_hf.QuasarConfig()
    ).eval()
    return model, AutoTokenizer.from_pretrained(source), {"source": source, "quantize_s": time.perf_counter() - start}


def timed_generate(model, prompts: list[list[int]], max_new_tokens: int, quasar, keep_logits: bool = False) -> dict:
    """Greedy tokens and seconds per prompt, after one untimed warm-up on the first prompt; with
    keep_logits, also the fp32 logits each greedy choice was made from (key "logits": [T, V] each)."""
    options = {"max_new_tokens": max_new_tokens, "do_sample": False}
    options["quasar"] = quasar if quasar is not None else plain_decoding(model).get("quasar")
    if options["quasar"] is None:
        del options["quasar"]
    if keep_logits:
        options.update(return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), **options)
        result: dict = {"tokens": [], "seconds": [], "logits": []}
        for ids in prompts:
            begin = time.perf_counter()
            out = model.generate(torch.tensor([ids]), **options)
            result["seconds"].append(time.perf_counter() - begin)
            sequences = out.sequences if keep_logits else out
            result["tokens"].append(sequences[0, len(ids) :].tolist())
            if keep_logits:
                result["logits"].append(torch.stack([step[0].float() for step in out.logits]))
    if not keep_logits:
        del result["logits"]
    return result


def top2_rows(logits: torch.Tensor) -> list[list[list[float]]]:
    """[[id, logit], [id, logit]] (best first) at each position of logits [T, V]."""
    values, indices = logits.topk(2, dim=-1)
    return [[[int(i), float(v)] for i, v in zip(row_i, row_v)] for row_i, row_v in zip(indices, values)]


def run_vllm(job: dict, python: Path, workdir: str, env_settings: dict[str, str], log_path: str) -> dict:
    """Run benchmarks/serve/vllm/worker.py with the vLLM venv's `python` on `job` (its output to log_path);
    its result dict."""
    job_path, result_path = os.path.join(workdir, "job.json"), os.path.join(workdir, "result.json")
    with open(job_path, "w") as handle:
        json.dump(job, handle)
    env = {**os.environ, **env_settings, "PYTHONPATH": ""}
    with open(log_path, "w") as log:
        status = subprocess.run(
            [str(python), str(REPO / "benchmarks" / "serve" / "vllm" / "worker.py"), job_path, result_path],
            cwd=workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        ).returncode
    result = json.load(open(result_path)) if os.path.exists(result_path) else {"modes": {}}
    if status != 0:
        tail = Path(log_path).read_text().splitlines()[-25:]
        result["error"] = f"worker exited with status {status}; last lines of its log:\n" + "\n".join(tail)
    return result


def check_model(name: str, args: argparse.Namespace, workdir: str) -> dict:
    """Everything for one model: export, our decoding, vLLM's, and the comparison."""
    from quasar_hf.export import export_compressed_tensors

    model, tokenizer, provenance = load_model(name, args.checkpoints.get(name), workdir if args.tiny else None)
    export_dir = os.path.join(args.out, f"export_{name}")  # a fixed path: vLLM's compile cache is keyed on it
    report = export_compressed_tensors(model, export_dir, tokenizer=tokenizer)
    prompts = prompt_ids(tokenizer)
    new = args.max_new_tokens
    ours = {
        "plain": timed_generate(model, prompts, new, None, keep_logits=True),
        "quasar_eager": timed_generate(model, prompts, new, True),
    }
    if not args.tiny:
        ours["quasar_compiled"] = timed_generate(model, prompts, new, {"compile": True})
    logits = ours["plain"].pop("logits")  # what our greedy choices were made from (not written out)
    result = {
        "model": name,
        "provenance": provenance,
        "prompt_ids": prompts,
        "export": {
            "quantized_modules": len(report.quantized_modules),
            "rotated_modules": len(report.rotated_modules),
            "max_fold_rel_error": report.max_fold_rel_error,
        },
        "ours": ours,
    }
    if args.tiny:
        result["vllm"] = {"skipped": "--tiny: mechanics only (vLLM is not run on tiny random models)"}
        return result
    job = {
        "model": export_dir,
        "prompt_ids": prompts,
        "max_new_tokens": new,
        "modes": ["plain", "ngram"] + ([] if args.skip_serve else ["serve"]),
        "ngram": NGRAM,
        # max_num_batched_tokens bounds vLLM's start-up profiling prefill, which runs the dense bf16
        # transform GEMMs (emulated on CPUs without native bf16): 8192 tokens took minutes per engine.
        # gpu_memory_utilization is the share of CPU memory vLLM's CPU backend reserves (default 0.92).
        "engine": {"dtype": "bfloat16", "max_model_len": 2048, "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.4},
        "chat": [{"role": "user", "content": PROMPTS[0]}],
        "serve_requests": 2,
    }
    result["vllm"] = run_vllm(job, args.vllm_python, workdir, args.vllm_env, os.path.join(args.out, f"vllm_{name}.log"))
    plain = result["vllm"]["modes"].get("plain")
    if plain:  # our decode-time logits: their top 2 everywhere (the noise floor), and vLLM's token where it differs
        result["ours_top2"] = [top2_rows(rows) for rows in logits]
        result["ours_logit_of_vllm_token"] = []
        for rows, mine, theirs in zip(logits, ours["plain"]["tokens"], plain["tokens"]):
            i = first_difference(mine, theirs)
            ok = i is not None and i < len(mine) and i < len(theirs)
            result["ours_logit_of_vllm_token"].append(float(rows[i, theirs[i]]) if ok else None)
    return result


def ensure_venv(venv: Path) -> None:
    """Build or reuse the vLLM venv, then install this checkout into it (for the quasar_vllm plugin)."""
    subprocess.run(["bash", str(REPO / "benchmarks" / "serve" / "vllm" / "make_venv.sh"), str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--no-build-isolation", "--force-reinstall"]
    subprocess.run([*pip, str(REPO)], check=True, cwd=tempfile.gettempdir())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--checkpoint", action="append", default=[], help="NAME=DIR: a saved Quasar checkpoint to use")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model: export and our side only")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--near-tie", type=float, default=1.0, help="largest logit gap (nats) a divergence may have")
    parser.add_argument("--venv", type=Path, default=REPO / ".venv-vllm", help="the vLLM venv (built here when missing)")
    parser.add_argument("--vllm-python", type=Path, help="a Python that already imports vLLM (skips --venv)")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--vllm-env", action="append", default=[], help="KEY=VALUE: override one vLLM CPU setting")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    args.checkpoints = dict(item.split("=", 1) for item in args.checkpoint)
    args.vllm_env = {**vllm_settings(), **dict(item.split("=", 1) for item in args.vllm_env)}
    args.build_venv = args.vllm_python is None and not args.tiny
    args.vllm_python = args.vllm_python or args.venv / "bin" / "python"
    if args.tiny:
        args.models = ["tiny"]
    return args


def main(argv: list[str] | None = None) -> int:
    from quasar_hf.bench.report import environment

    args = parse_args(argv)
    if args.build_venv:
        ensure_venv(args.venv)
    result: dict = {
        "command": "python -m benchmarks vllm-check " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": environment(),
        "vllm_settings": args.vllm_env,
        "prompts": list(PROMPTS),
        "max_new_tokens": args.max_new_tokens,
        "near_tie_nats": args.near_tie,
        "models": {},
    }
    os.makedirs(args.out, exist_ok=True)
    for name in args.models:
        with tempfile.TemporaryDirectory() as workdir:
            raw = check_model(name, args, workdir)
        result["models"][name] = {**raw, "summary": summarize_model(raw, args.near_tie)}
        with open(os.path.join(args.out, "vllm_check.json"), "w") as handle:
            json.dump(result, handle, indent=1, default=str)
    markdown = to_markdown(result)
    Path(args.out, "vllm_check.md").write_text(markdown)
    print(markdown)
    return 0 if all(m["summary"]["passed"] in (True, None) for m in result["models"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
