"""Where the serving scheduler's time goes: clients sending requests one after another through RequestBatcher in one
process (no HTTP), greedy or sampled, with each step's time split by the rows it ran.

    python -m benchmarks scheduler-profile --quantized DIR [--mode sampled] [--clients 1 4] [--max-tokens 64]

Per client count: aggregate tokens/s; per step width (rows): steps, the verifier forward, the rest of the step
(processors, acceptance, the draw, emission) and drafting, in ms per step; the prefills (count, ms each, run
alone while the other rows wait). From the steps alone: the tokens/s the widest steps would give against one
row's steps, the ceiling of the clients' ratio without prefills and partly filled steps. Prompts: the shipped
chat suite through the checkpoint's chat template. The model loads in a thread that ends with the load, as the
server loads it (admission_mix.py says why).
"""

from __future__ import annotations

import argparse
import sys
import threading

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

import quasar_hf  # noqa: F401  (registers the Quasar model classes)
from benchmarks.serve.serve_clients import from_clients
from quasar_hf.bench.report import environment, write_json_and_markdown
from quasar_hf.bench.suites import load_suites, render_prompt
from quasar_hf.speculative.batch_request import BatchRequest
from quasar_hf.speculative.batcher import RequestBatcher
from quasar_hf.speculative.own_thread import in_own_thread
from quasar_hf.speculative.stats import QuasarStats


class StepTimes:
    """The scheduler's on_call: per step width, steps and seconds (forward, whole step, drafting); prefills."""

    def __init__(self) -> None:
        self.by_rows: dict[int, list[float]] = {}  # rows -> [steps, forward_s, verify_s, draft_s]
        self.prefills: list[float] = []

    def reset(self) -> None:
        self.by_rows, self.prefills = {}, []

    def __call__(self, stats: QuasarStats, rows: int) -> None:
        if rows == 0:
            self.prefills.append(stats.prefill_time_s)
            return
        into = self.by_rows.setdefault(rows, [0, 0.0, 0.0, 0.0])
        into[0] += 1
        into[1] += stats.forward_time_s
        into[2] += stats.verify_time_s
        into[3] += stats.draft_time_s

    def summary(self) -> dict:
        steps = {}
        for rows, (count, forward, verify, draft) in sorted(self.by_rows.items()):
            steps[str(rows)] = {
                "steps": int(count),
                "forward_ms": round(1e3 * forward / count, 2),
                "rest_of_step_ms": round(1e3 * (verify - forward) / count, 2),
                "draft_ms": round(1e3 * draft / count, 2),
            }
        mean = 1e3 * sum(self.prefills) / len(self.prefills) if self.prefills else None
        return {"steps": steps, "prefills": len(self.prefills), "prefill_ms": None if mean is None else round(mean, 1)}


def run_clients(batcher, tokenizer, prompts, clients: int, requests: int, args) -> float:
    """`requests` requests from `clients` clients, each sending its next when its last ends; aggregate tokens/s."""
    lock, tokens = threading.Lock(), [0]

    def one_request(index: int) -> None:
        done, count = threading.Event(), [0]
        sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
        config = GenerationConfig(
            max_new_tokens=args.max_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **(sampling if args.mode == "sampled" else {"do_sample": False}),
        )
        generator = torch.Generator().manual_seed(index) if args.mode == "sampled" else None
        request = BatchRequest(
            list(prompts[index % len(prompts)]),
            config,
            lambda ids: count.__setitem__(0, count[0] + len(ids)),
            lambda error: done.set(),
            tokenizer=tokenizer,
            generator=generator,
        )
        batcher.submit(request)
        done.wait()
        with lock:
            tokens[0] += count[0]

    seconds = from_clients(requests, clients, one_request)
    return tokens[0] / seconds


def to_markdown(report: dict) -> str:
    lines = ["# Where the serving scheduler's time goes", "", f"`{report['command']}`", ""]
    lines += [f"{report['mode']} requests of {report['max_tokens']} tokens, chat prompts, in one process.", ""]
    lines += ["| clients | tokens/s | step rows | steps | forward ms | rest of step ms | draft ms | prefills (ms each) |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for level in report["levels"]:
        first = True
        for rows, step in level["steps"].items():
            head = [level["clients"], level["tokens_per_s"]] if first else ["", ""]
            tail = f"{level['prefills']} ({level['prefill_ms']})" if first else ""
            cells = [*head, rows, step["steps"], step["forward_ms"], step["rest_of_step_ms"], step["draft_ms"], tail]
            lines.append("| " + " | ".join(map(str, cells)) + " |")
            first = False
    if report.get("steps_only_ratio") is not None:
        lines += ["", f"From the steps alone: {report['steps_only_ratio']}x ({report['steps_only_note']})."]
    lines += ["", f"Environment: {report['environment']}", ""]
    return "\n".join(lines)


def steps_only_ratio(levels: list[dict]) -> tuple[float | None, str]:
    """Tokens per second of the widest level's full steps over one row's steps (one token per row and step)."""
    one = next((lv["steps"].get("1") for lv in levels if lv["clients"] == 1), None)
    widest = max(levels, key=lambda lv: lv["clients"])
    full = widest["steps"].get(str(widest["clients"]))
    if one is None or full is None or widest["clients"] == 1:
        return None, ""
    per_one = one["forward_ms"] + one["rest_of_step_ms"] + one["draft_ms"]
    per_full = full["forward_ms"] + full["rest_of_step_ms"] + full["draft_ms"]
    ratio = widest["clients"] * per_one / per_full
    return round(ratio, 2), f"{widest['clients']} rows per {per_full:.1f} ms step against 1 row per {per_one:.1f} ms"


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks scheduler-profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantized", required=True, help="a saved Quasar checkpoint")
    parser.add_argument("--mode", choices=("greedy", "sampled"), default="sampled")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--out", default="out/scheduler_profile")
    parser.add_argument("--name", default="scheduler_profile")
    args = parser.parse_args(argv)
    if min(args.clients) < 1 or args.requests_per_client < 1 or args.max_tokens < 1:
        parser.error("--clients, --requests-per-client and --max-tokens must be >= 1")
    model = in_own_thread(lambda: AutoModelForCausalLM.from_pretrained(args.quantized).eval()).result()
    tokenizer = AutoTokenizer.from_pretrained(args.quantized)
    prompts = [render_prompt(item, tokenizer) for item in load_suites("chat")]
    times = StepTimes()
    batcher = RequestBatcher(model, quasar={"drafter": "auto"}, on_call=times)  # the server's default drafter
    levels = []
    try:
        run_clients(batcher, tokenizer, prompts, max(args.clients), max(args.clients), args)  # warm-up
        for clients in args.clients:
            times.reset()
            tokens_per_s = run_clients(batcher, tokenizer, prompts, clients, clients * args.requests_per_client, args)
            levels.append({"clients": clients, "tokens_per_s": round(tokens_per_s, 1), **times.summary()})
            print(levels[-1], flush=True)
    finally:
        batcher.stop()
    ratio, note = steps_only_ratio(levels)
    settings = {k: getattr(args, k) for k in ("mode", "max_tokens", "temperature", "top_p", "requests_per_client")}
    command = "python -m benchmarks scheduler-profile " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {"command": command.strip(), **settings, "levels": levels, "environment": environment()}
    report.update(steps_only_ratio=ratio, steps_only_note=note)
    return write_json_and_markdown(report, args.out, args.name, to_markdown)


if __name__ == "__main__":
    main()
