"""Are compiled steps of a saved Quasar checkpoint row-stable? Over a static KV cache, one compiled
verify call of k+1 tokens against k+1 compiled one-token decode calls, per compile mode, with the
compile times and the number of graphs Dynamo made.

    python -m benchmarks compiled-rows --quantized DIR [--modes aot_eager,inductor,inductor_emulate_casts]
        --out benchmarks/compiled_rows_cpu.json

Modes: "aot_eager" (Dynamo + AOTAutograd, eager kernels), "inductor" (default options),
"inductor_emulate_casts" (Inductor with `emulate_precision_casts`, passed per compile call, which
rounds low-precision intermediates where eager does). Equal rows are what greedy `quasar=True`
needs to equal plain greedy decoding in compiled mode; compiled need not equal eager.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

MODES = {
    "aot_eager": {"backend": "aot_eager"},
    "inductor": {"backend": "inductor"},
    "inductor_emulate_casts": {"backend": "inductor", "options": {"emulate_precision_casts": True}},
}


def _step(forward, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[1])[None]
    return forward(input_ids=ids, position_ids=positions, cache_position=positions[0], past_key_values=cache).logits


def compare_mode(model, mode: str, prompt: torch.Tensor, drafts: torch.Tensor, cache_len: int) -> dict:
    """Compile model.forward in `mode`; time the first verify and decode calls; compare the rows."""
    import torch._dynamo
    from transformers import StaticCache

    def prefilled():
        cache = StaticCache(config=model.config, max_cache_len=cache_len)
        _step(model.forward, cache, prompt, 0)
        return cache

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, **MODES[mode])
    start = prompt.shape[1]
    began = time.perf_counter()
    verify = _step(compiled, prefilled(), drafts, start)
    verify_s = time.perf_counter() - began
    cache = prefilled()
    began = time.perf_counter()
    rows = [_step(compiled, cache, drafts[:, i : i + 1], start + i) for i in range(drafts.shape[1])]
    decode_s = time.perf_counter() - began
    decode = torch.cat(rows, dim=1)
    differ = (decode != verify).any(-1)[0]  # [k+1]: which rows differ
    return {
        "mode": mode,
        "rows_equal": bool(torch.equal(decode, verify)),
        "rows_differing": int(differ.sum()),
        "max_abs_logit_diff": float((decode.float() - verify.float()).abs().max()),
        "same_argmax": bool(torch.equal(decode.argmax(-1), verify.argmax(-1))),
        "first_verify_call_s": round(verify_s, 1),
        "first_decode_calls_s": round(decode_s, 1),
        "unique_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
    }


def to_markdown(report: dict) -> str:
    lines = [
        f"# Compiled rows: {report['model']} ({report['dtype']})",
        "",
        f"Command: `{report['command']}`",
        "",
        f"{report['draft_tokens']} tokens verified in one compiled call vs one compiled call per token, "
        f"after a {report['prompt_tokens']}-token eager prefill, static cache of {report['cache_len']}. "
        "First calls include compilation.",
        "",
        "| mode | rows equal | rows differing | max abs logit diff | same argmax | verify compile+run s | decode compile+runs s | graphs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['mode']} | {'yes' if r['rows_equal'] else 'no'} | {r['rows_differing']} | {r['max_abs_logit_diff']:.3g} | "
            f"{'yes' if r['same_argmax'] else 'no'} | {r['first_verify_call_s']} | {r['first_decode_calls_s']} | {r['unique_graphs']} |"
        )
    env = report["environment"]
    lines += ["", f"Environment: {env.get('cpu')}, torch {env.get('versions', {}).get('torch')}, {report['threads']} threads."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks compiled-rows", description=__doc__.splitlines()[0])
    parser.add_argument("--quantized", required=True, help="a saved Quasar checkpoint")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--draft-tokens", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/compiled_rows_cpu.json")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"unknown modes {unknown}; choose from {list(MODES)}")

    from transformers import AutoModelForCausalLM

    import quasar_hf  # noqa: F401  (registers quant_method "quasar")
    from quasar_hf.bench.report import environment

    model = AutoModelForCausalLM.from_pretrained(args.quantized).eval()
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    drafts = torch.randint(0, vocab, (1, args.draft_tokens), generator=torch.Generator().manual_seed(1))
    cache_len = args.prompt_tokens + args.draft_tokens + 16
    with torch.no_grad():
        results = [compare_mode(model, mode, prompt, drafts, cache_len) for mode in modes]
    report = {
        "command": "python -m benchmarks compiled-rows " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": model.config.name_or_path.rstrip("/").split("/")[-1],
        "dtype": str(model.dtype).removeprefix("torch."),
        "prompt_tokens": args.prompt_tokens,
        "draft_tokens": args.draft_tokens,
        "cache_len": cache_len,
        "threads": torch.get_num_threads(),
        "results": results,
        "environment": environment(),
    }
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    with open(args.out.removesuffix(".json") + ".md", "w") as fh:
        fh.write(to_markdown(report))
    print(to_markdown(report))
    return report


if __name__ == "__main__":
    main()
