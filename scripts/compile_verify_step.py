"""A SmolLM2-135M W8A8 verify step (6 tokens over a 300-token cache), eager vs `torch.compile`.

Reports the step time of each mode and whether the compiled logits equal the eager ones bit for
bit (the condition for `QuasarHfQuantizer.is_compileable`). Modes: "eager"; "inductor" (default
settings); "inductor_emulate_casts" (`torch._inductor.config.emulate_precision_casts = True`, which
rounds intermediate BF16 results as eager does).

    python scripts/compile_verify_step.py [--steps 20] [--out benchmarks/compile_verify_step_cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from quasar_hf import QuasarConfig
from quasar_hf.bench.report import environment
from quasar_hf.models import smollm2_135m_instruct

CACHE_TOKENS, VERIFY_TOKENS = 300, 6


def verify_step(forward, model, prefix: torch.Tensor, draft: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Logits of `draft` [1, 6] over the cache; the cache is cut back to the prefix afterwards."""
    logits = forward(input_ids=draft, past_key_values=cache, use_cache=True).logits
    cache.crop(-draft.shape[1])
    return logits


def measure(model, mode: str, prefix, draft, steps: int) -> dict:
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = mode == "inductor_emulate_casts"
    torch._dynamo.reset()
    forward = model.forward if mode == "eager" else torch.compile(model.forward, dynamic=False)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prefix, past_key_values=cache, use_cache=True)  # eager prefill, same in every mode
        start = time.perf_counter()
        logits = verify_step(forward, model, prefix, draft, cache)
        first_s = time.perf_counter() - start
        for _ in range(3):
            verify_step(forward, model, prefix, draft, cache)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            verify_step(forward, model, prefix, draft, cache)
            times.append(time.perf_counter() - start)
    times.sort()
    return {"first_call_s": first_s, "median_ms": times[len(times) // 2] * 1e3, "min_ms": times[0] * 1e3, "logits": logits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="eager,inductor_emulate_casts,inductor")
    parser.add_argument("--out", default="benchmarks/compile_verify_step_cpu")
    parser.add_argument("--quantized", help="a saved Quasar checkpoint (default: quantize now with few samples)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quantized:
        model = AutoModelForCausalLM.from_pretrained(args.quantized)
    else:
        config = QuasarConfig(alpha=0.5, num_calibration_samples=4, calibration_seq_len=128)  # timing only
        model = AutoModelForCausalLM.from_pretrained(smollm2_135m_instruct(), quantization_config=config, dtype=torch.bfloat16)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, model.config.vocab_size, (1, CACHE_TOKENS), generator=gen)
    draft = torch.randint(0, model.config.vocab_size, (1, VERIFY_TOKENS), generator=gen)
    rows, eager_logits = {}, None
    for mode in args.modes.split(","):
        row = measure(model, mode, prefix, draft, args.steps)
        logits = row.pop("logits")
        eager_logits = logits if mode == "eager" else eager_logits
        if eager_logits is not None:
            row["logits_equal_eager"] = bool(torch.equal(logits, eager_logits))
            row["max_abs_logit_diff"] = float((logits.float() - eager_logits.float()).abs().max())
        rows[mode] = row
        print(mode, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        write(args, model, rows)


def write(args, model, rows: dict) -> None:
    """The JSON so far (written after each mode, so a long compile never loses the earlier rows)."""
    result = {
        "command": "python scripts/compile_verify_step.py " + " ".join(sys.argv[1:]),
        "attn_implementation": model.config._attn_implementation,
        "cache_tokens": CACHE_TOKENS,
        "verify_tokens": VERIFY_TOKENS,
        "steps": args.steps,
        "rows": rows,
        "environment": environment(),
        "note": "measured on a shared 2-core VM while other jobs ran: compare modes within this run only",
    }
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
