"""A chat turn's prefill over its cached history: the forward the server runs when a request continues from the
prompt cache, timed with the mask read in every layer (what plain `generate` does) and with one MaskFacts per
forward (what the speculative loop passes), interleaved, the logits compared bit for bit.

    python -m benchmarks turn-prefill --checkpoint DIR [--history 2400] [--turn 300] [--rounds 12]

Random token ids (the prefill's cost does not depend on them); the history's keys and values are computed once
and copied before each timed forward, outside the timing.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401  (registers the Quasar model classes)
from quasar_hf import compat
from quasar_hf.bench.report import environment, write_json_and_markdown
from quasar_hf.ops.rowstable_attention import MASK_FACTS_KWARG, MaskFacts

VARIANTS = ("mask read per layer", "MaskFacts per forward")


def turn_forward(model, turn: torch.Tensor, history_cache, history: int, facts: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one turn's forward over a copy of the history's cache, and its last logits."""
    past = {compat.cache_argument_name(model): copy.deepcopy(history_cache)}
    extra = {MASK_FACTS_KWARG: MaskFacts()} if facts else {}
    length = history + turn.shape[1]
    started = time.perf_counter()
    logits = model(
        turn,
        attention_mask=torch.ones(1, length, dtype=torch.long),  # Transformers builds the bottom-right causal mask
        position_ids=torch.arange(history, length)[None],
        logits_to_keep=1,
        **past,
        **extra,
    ).logits
    return time.perf_counter() - started, logits


def measure(model, history: int, turn_tokens: int, rounds: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    first = torch.randint(0, vocab, (1, history), generator=generator)
    turn = torch.randint(0, vocab, (1, turn_tokens), generator=generator)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    logits: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        cache = model(first, use_cache=True).past_key_values
        for _ in range(rounds):
            for name in VARIANTS:
                seconds, logits[name] = turn_forward(model, turn, cache, history, name == VARIANTS[1])
                times[name].append(seconds)
    medians = {name: statistics.median(values[1:] or values) for name, values in times.items()}  # the first warms up
    ratios = [b / a for a, b in zip(times[VARIANTS[0]], times[VARIANTS[1]])]
    return {
        "history": history,
        "turn": turn_tokens,
        "median_ms": {name: round(1e3 * value, 2) for name, value in medians.items()},
        "ms_by_round": {name: [round(1e3 * v, 2) for v in values] for name, values in times.items()},
        "ratio_median": round(statistics.median(ratios[1:] or ratios), 4),
        "same_logits": bool(torch.equal(logits[VARIANTS[0]], logits[VARIANTS[1]])),
    }


def to_markdown(report: dict) -> str:
    lines = [
        "# A chat turn's prefill over its cached history: the mask read per layer or once per forward",
        "",
        f"`{report['command']}`",
        "",
        f"{report['rounds']} rounds, the variants interleaved; median of the rounds after the first.",
        "",
        "| history | turn | "
        + " | ".join(f"{v} ms" for v in VARIANTS)
        + " | MaskFacts / per layer (median per round) | same logits |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        times = " | ".join(str(row["median_ms"][v]) for v in VARIANTS)
        lines.append(f"| {row['history']} | {row['turn']} | {times} | {row['ratio_median']} | {row['same_logits']} |")
    lines += ["", f"Environment: {report['environment']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks turn-prefill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a saved Quasar checkpoint")
    parser.add_argument("--history", type=int, nargs="+", default=[2400], help="cached tokens before the turn")
    parser.add_argument("--turn", type=int, default=300, help="the turn's new tokens")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", default="out/turn_prefill")
    parser.add_argument("--name", default="turn_prefill")
    args = parser.parse_args(argv)
    if args.turn < 1 or args.rounds < 1 or min(args.history) < 1:
        parser.error("--turn, --rounds and every --history must be >= 1")
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16).eval()
    rows = []
    for history in args.history:
        rows.append(measure(model, history, args.turn, args.rounds))
        print(rows[-1]["median_ms"], rows[-1]["ratio_median"], flush=True)
    command = "python -m benchmarks turn-prefill " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {"command": command.strip(), "rounds": args.rounds, "rows": rows, "environment": environment()}
    return write_json_and_markdown(report, args.out, args.name, to_markdown)


if __name__ == "__main__":
    main()
