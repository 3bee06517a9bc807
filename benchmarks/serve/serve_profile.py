"""Where one client's time goes: the serve-load prompts decoded offline, one at a time, in each mode a
server runs, with Quasar's own timers split into prefill, drafting, verifier forwards and the rest.

    python -m benchmarks serve-profile --model smollm2 --serve-load benchmarks/reports/serve-load/serve_load_smollm2_zen4.json

Per mode: tokens/s; the share of time in the prefill, the drafter, the verifier forwards and the loop
around them; verifier forwards per new token (1.0 = plain decoding); the mean forward's time against
the bytes floor (int8 weights + lm_head over the read bandwidth measured here). With --serve-load, the
same run's served tokens/s at 1 client sit beside it (server overhead = offline / served), and
llama-server's best mode at 1 client.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks import reports_dir
from benchmarks.serve.serve_load import interleaved_prompts
from quasar_hf.bench.report import environment, markdown_table, write_json_and_markdown

# mode -> (quasar argument of generate, the serve-load row it corresponds to, what it is)
MODES = {
    "eager-plain": (False, "quasar_off", "eager plain decoding"),
    "eager-auto": ({"drafter": "auto"}, "quasar", "eager `quasar=True`, drafter auto (the server's default)"),
    "eager-ngram": ({"drafter": "ngram"}, None, "eager `quasar=True`, n-gram drafts always"),
    "compiled-plain": ({"compile": True, "num_draft_tokens": 0}, "quasar-compiled_off", "compiled plain decoding"),
    "compiled-auto": ({"compile": True, "drafter": "auto"}, "quasar-compiled", "compiled `quasar=True`, drafter auto"),
}


def profile_mode(model, prompts, quasar, max_tokens: int) -> dict:
    """Decode every prompt alone; totals of Quasar's timers (plain decoding has none: its time is all forwards)."""
    totals = {"seconds": 0.0, "tokens": 0, "prefill_s": 0.0, "draft_s": 0.0, "forward_s": 0.0, "forwards": 0, "accepted": 0}
    for prompt in prompts:
        ids = torch.tensor([prompt.ids])
        started = time.perf_counter()
        options = {"quasar": quasar} if quasar is False else {"quasar": quasar, "return_dict_in_generate": True}
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, **options)
        totals["seconds"] += time.perf_counter() - started
        sequences = out if quasar is False else out.sequences
        totals["tokens"] += sequences.shape[1] - ids.shape[1]
        stats = None if quasar is False else out.quasar_stats
        if stats is not None:
            totals["prefill_s"] += stats.prefill_time_s
            totals["draft_s"] += stats.draft_time_s
            totals["forward_s"] += stats.forward_time_s
            totals["forwards"] += stats.verifier_forwards
            totals["accepted"] += stats.accepted_tokens
    return totals


def summarize(totals: dict, floor_ms: float) -> dict:
    seconds, tokens = totals["seconds"], totals["tokens"]
    row = {"tokens_per_s": round(tokens / seconds, 2), "seconds": round(seconds, 2), "tokens": tokens}
    if totals["forwards"]:
        forward_ms = totals["forward_s"] / totals["forwards"] * 1e3
        row.update(
            prefill_share=round(totals["prefill_s"] / seconds, 3),
            draft_share=round(totals["draft_s"] / seconds, 3),
            forward_share=round(totals["forward_s"] / seconds, 3),
            loop_share=round(1 - (totals["prefill_s"] + totals["draft_s"] + totals["forward_s"]) / seconds, 3),
            forwards_per_token=round(totals["forwards"] / tokens, 3),
            accepted_per_forward=round(totals["accepted"] / totals["forwards"], 3),
            forward_ms=round(forward_ms, 2),
            forward_over_floor=round(forward_ms / floor_ms, 2),
        )
    return row


def served_at_one_client(path: str | None, alias: str) -> dict:
    """tokens/s at 1 client per served row of a serve-load report, or {}."""
    if not path:
        return {}
    servers = json.loads(Path(path).read_text())["models"][alias]["servers"]
    return {name: data["levels"]["1"]["tokens_per_s"] for name, data in servers.items() if "1" in data.get("levels", {})}


def to_markdown(result: dict) -> str:
    served = result["served_1_client"]
    header = ["mode", "offline tok/s", "served tok/s", "prefill", "draft", "forwards", "loop", "forwards / token"]
    header += ["forward ms (x floor)"]
    rows = []
    for mode, row in result["modes"].items():
        share = lambda key: f"{row[key]:.0%}" if key in row else "-"  # noqa: E731
        served_row = served.get(MODES[mode][1] or "", "-")
        rows.append(
            [
                MODES[mode][2],
                row["tokens_per_s"],
                served_row,
                share("prefill_share"),
                share("draft_share"),
                share("forward_share"),
            ]
            + [
                share("loop_share"),
                row.get("forwards_per_token", "1.0"),
                f"{row['forward_ms']} ({row['forward_over_floor']}x)" if "forward_ms" in row else "-",
            ]
        )
    llama = {k: v for k, v in served.items() if k.startswith("llamacpp")}
    lines = [
        f"# Where one client's time goes: {result['model']}, {result['prompts']} serve-load prompts, {result['max_tokens']} tokens each",
        "",
        f"`{result['command']}`",
        "",
        f"Bytes floor of a forward: {result['floor']['bytes'] / 1e6:.1f} MB at {result['floor']['read_gbps']} GB/s = "
        f"{result['floor']['ms']} ms. Shares are of each mode's wall time (Quasar's timers; plain decoding has none).",
        "",
        *markdown_table(header, rows),
    ]
    if llama:
        best = max(llama, key=llama.get)
        lines += [
            "",
            f"llama-server at 1 client, same serve-load run: best `{best}` {llama[best]} tok/s; plain {llama.get('llamacpp', '-')}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks serve-profile", description=__doc__)
    parser.add_argument("--model", default="smollm2", help="an embedded model alias or a folder (quantized once and cached)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--serve-load", help="a serve-load report of the same model (served tokens/s at 1 client)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    parser.add_argument("--out", default=reports_dir("serve-load"))
    parser.add_argument("--name", default="serve_profile")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import quasar_hf
    from benchmarks.kernels.kernels import measure_read_bandwidth
    from quasar_hf.commands.loading import resolve_model
    from quasar_hf.commands.serve import servable_checkpoint
    from quasar_hf.nn.weight_bytes import step_read_bytes

    checkpoint = servable_checkpoint(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    prompts = interleaved_prompts(tokenizer, args.requests)
    gbps = measure_read_bandwidth(torch.device("cpu"))
    floor = {"bytes": step_read_bytes(model), "read_gbps": round(gbps, 2), "ms": round(step_read_bytes(model) / gbps / 1e6, 3)}
    modes = [m for m in args.modes.split(",") if m]
    if any("compiled" in m for m in modes):
        quasar_hf.warm_up(model, batch_sizes=[1], progress=False)
    result = {"environment": environment(), "command": "python -m benchmarks serve-profile " + " ".join(argv or [])}
    result.update(
        model=args.model, checkpoint=checkpoint, prompts=len(prompts), max_tokens=args.max_tokens, floor=floor, modes={}
    )
    for mode in modes:
        result["modes"][mode] = summarize(profile_mode(model, prompts, MODES[mode][0], args.max_tokens), floor["ms"])
        print(mode, result["modes"][mode], flush=True)
    result["served_1_client"] = served_at_one_client(args.serve_load, args.model)
    return write_json_and_markdown(result, Path(args.out), args.name, to_markdown)
