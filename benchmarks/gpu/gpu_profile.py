"""gpu-check's step profile: one eager verify step under torch.profiler, as launches and host vs device time.

For a step of `1 + draft` tokens over a cached context: the kernels the device ran (count and summed
time), the runtime's launch calls, the step's host wall time under the profiler, and per quasar::
op its calls and host microseconds per call (the Python and dispatch overhead a CUDA graph removes).
On CPU (`--tiny`) there are no device kernels: the op counts and host times still come out.
"""

from __future__ import annotations

import time

import torch

LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def profile_step(model: torch.nn.Module, device: str, tiny: bool, draft_tokens: int = 5) -> dict:
    """Profile one verify step of `1 + draft_tokens` tokens (after two unprofiled warm-up steps)."""
    from torch.profiler import ProfilerActivity, profile

    from quasar_hf.bench.fidelity import cached_forward

    context = 64 if tiny else 1024
    ids = torch.randint(0, model.config.vocab_size, (1, context + draft_tokens + 1), device=device)
    _, cache = cached_forward(model, ids[:, :context], None)
    block = ids[:, context:]

    def step() -> None:
        nonlocal cache
        _, cache = cached_forward(model, block, cache)
        cache.crop(-(draft_tokens + 1))
        if device == "cuda":
            torch.cuda.synchronize()

    step()
    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - start) * 1e3
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    averages = {a.key: a for a in prof.key_averages()}
    quasar_ops = {
        name: {"calls": a.count, "host_us_per_call": a.cpu_time_total / a.count}
        for name, a in averages.items()
        if name.startswith("quasar::") and a.count
    }
    return {
        "tokens_per_step": draft_tokens + 1,
        "context": context,
        "host_ms_profiled": host_ms,
        "device_kernels": len(kernels) if device == "cuda" else None,
        "device_kernel_ms": sum(e.device_time_total for e in kernels) / 1e3 if device == "cuda" else None,
        "launch_calls": sum(averages[name].count for name in LAUNCH_CALLS if name in averages),
        "aten_ops": sum(a.count for name, a in averages.items() if name.startswith("aten::")),
        "quasar_ops": quasar_ops,
        "decoder_layers": model.config.num_hidden_layers,
    }


def profile_markdown(result: dict) -> list[str]:
    """The profile sections of a gpu-check result as markdown lines."""
    from quasar_hf.bench.report import markdown_table

    lines: list[str] = []
    for key in ("profile_bf16", "profile_w8a8"):
        got = result.get(key)
        if not got or "error" in got:
            continue
        layers = got["decoder_layers"]
        lines += [f"## One eager {got['tokens_per_step']}-token verify step, profiled ({key.split('_')[1].upper()})", ""]
        lines += markdown_table(
            ["measure", "value"],
            [
                ["host wall ms (profiled)", got["host_ms_profiled"]],
                ["device kernels", got["device_kernels"]],
                ["device kernels per decoder layer", None if got["device_kernels"] is None else got["device_kernels"] / layers],
                ["device kernel ms (sum)", got["device_kernel_ms"]],
                ["runtime launch calls", got["launch_calls"]],
                ["aten ops", got["aten_ops"]],
            ],
        )
        if got["quasar_ops"]:
            lines += [""] + markdown_table(
                ["quasar op", "calls", "host us per call"],
                [[name, op["calls"], op["host_us_per_call"]] for name, op in sorted(got["quasar_ops"].items())],
            )
        lines.append("")
    return lines
