"""Reports: JSON (with the environment), a markdown summary, and matplotlib PNG plots.

`write_reports(result, out_dir, name)` accepts any mix of these sections in `result`:
  "variants"/"headline"  from `runner.run_bench`        -> table + tokens/s and acceptance plots
  "fidelity"             from `fidelity.evaluate_fidelity` -> table
  "kernels"              rows {shape, M, backend, speedup_vs_bf16, gbps?} -> table + speedup-vs-M plot
  "command"              the exact command line that produced the result
matplotlib is optional: without it the plots are skipped and the JSON says why.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from typing import Any

import torch

from quasar_hf.bench.peers import report_names

_PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "triton",
    "bitsandbytes",
    "datasets",
    "torchao",
    "llama_cpp_python",
    "quasar-hf",
)


def _cpu_model() -> str:
    """CPU model name from /proc/cpuinfo (Linux) or platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _git_commit() -> str | None:
    """The repository's HEAD commit, when run from a git checkout."""
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(packages: tuple[str, ...] = _PACKAGES, device: Any = None) -> dict:
    """Versions (of `packages`), CPU/GPU, memory, threads and load: what a reader needs to judge a measurement
    (the one environment block of every report; `device`: the torch device measured, when not the CPU)."""
    versions = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": versions,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "git_commit": _git_commit(),
        "cuda": None,
    }
    if device is not None:
        env["device"] = str(device)
        if torch.device(device).type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(device)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["cuda"] = {
            "device": props.name,
            "memory_bytes": props.total_memory,
            "cuda_version": torch.version.cuda,
            "capability": list(torch.cuda.get_device_capability(0)),
        }
    return env


# ---------------------------------------------------------------- markdown
def _fmt(value: Any, digits: int = 3) -> str:
    """Numbers rounded for tables; None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """Markdown table lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines


def variants_table(result: dict) -> list[str]:
    """The headline: tokens/s, speedup vs the BF16-verify loop, L, step times, memory per variant."""
    header = [
        "variant",
        "tokens/s (median)",
        "x vs bf16_verify_ngram",
        "L",
        "acceptance rate",
        "ms / verify step",
        "us / draft token",
        "peak memory (MiB)",
        "same tokens as bf16",
        "x vs quasar_ngram",
        "same tokens as own plain greedy",
    ]
    rows = []
    quasar = result["variants"].get("quasar_ngram", {}).get("tokens_per_s_median")
    labels = report_names(list(result["variants"]))
    for name, s in result["variants"].items():
        step = s.get("time_per_verify_step_s")
        draft = s.get("time_per_draft_token_s")
        memory = s.get("peak_memory_bytes")
        rows.append(
            [
                labels[name],
                s["tokens_per_s_median"],
                result.get("headline", {}).get(name),
                s.get("mean_acceptance_length"),
                s.get("acceptance_rate"),
                step * 1e3 if step is not None else None,
                draft * 1e6 if draft is not None else None,
                memory / 2**20 if memory else None,
                s.get("same_tokens_as_bf16_generate"),
                s["tokens_per_s_median"] / quasar if quasar else None,
                s.get("same_tokens_as_own_plain_greedy"),
            ]
        )
    return markdown_table(header, rows)


def _generation_notes(variants: dict) -> list[str]:
    """Ratios the targets are stated in (vs prompt lookup, L ratio with its interval) and how to read
    the token-agreement column."""
    lines = []
    lookup = variants.get("bf16_prompt_lookup", {}).get("tokens_per_s_median")
    for name, s in variants.items():
        if name.startswith("quasar_") and lookup:
            lines += [f"- `{name}` / `bf16_prompt_lookup` tokens/s: {s['tokens_per_s_median'] / lookup:.3f}"]
        lr = s.get("L_ratio_vs_baseline")
        if lr:
            lines += [
                f"- L of `{name}` / L of `{lr['baseline']}`: {lr['ratio']:.3f} (paired bootstrap 95% "
                f"interval over the {lr['prompts']} prompts: {lr['ci95'][0]:.3f} - {lr['ci95'][1]:.3f})"
            ]
    if any(n.startswith(("quasar_", "bf16_verify")) for n in variants):
        lines += [
            "- The speculative-loop variants (`bf16_verify_*`, `quasar_*`) run the row-stable attention kernel "
            "that Quasar models load with (the BF16 verifier is switched to it for its calls, so both verifiers "
            "differ in their linears only); `bf16_generate` and `bf16_prompt_lookup` run Transformers' SDPA. "
            "In bf16 the two attentions round differently, so the loops' agreement with `bf16_generate` is "
            "below 1 without either being wrong; equality with plain greedy decoding under the same attention "
            "is what the tests check."
        ]
    return lines + ([""] if lines else [])


def fidelity_table(fidelity: dict) -> list[str]:
    """Perplexities, agreement, KL, and L of W8A8 vs BF16 verification."""
    nt = fidelity["next_token"]
    rows = [
        ["perplexity (W8A8)", nt["perplexity_model"]],
        ["perplexity (reference)", nt["perplexity_reference"]],
        ["perplexity ratio", nt["perplexity_ratio"]],
        ["top-1 agreement", nt["top1_agreement"]],
        ["mean KL (nats)", nt["mean_kl_nats"]],
        ["tokens evaluated", nt["tokens_evaluated"]],
    ]
    for mode, acc in (fidelity.get("acceptance") or {}).items():
        if isinstance(acc, dict) and "model" in acc:
            rows += [
                [f"L {mode} (W8A8)", acc["model"].get("mean_acceptance_length")],
                [f"L {mode} (reference)", acc["reference"].get("mean_acceptance_length")],
                [f"L ratio {mode}", acc.get("L_ratio")],
            ]
    return markdown_table(["metric", "value"], rows)


def kernels_table(rows: list[dict]) -> list[str]:
    """Kernel micro-benchmark rows: shape, M, backend, time, speedup vs BF16, GB/s."""
    return markdown_table(
        ["shape", "M", "backend", "us", "x vs bf16", "GB/s"],
        [[r.get("shape"), r.get("M"), r.get("backend"), r.get("time_us"), r.get("speedup_vs_bf16"), r.get("gbps")] for r in rows],
    )


def title_and_command(title: str, command: str | None) -> list[str]:
    """The opening lines of a report: its title and, when known, the command that made it."""
    lines = [f"# {title}", ""]
    if command:
        lines += ["Command:", "", "```", command, "```", ""]
    return lines


def to_markdown(result: dict, title: str = "quasar_hf benchmark") -> str:
    """One markdown document with every section present in `result`."""
    lines = title_and_command(title, result.get("command"))
    env = result.get("environment") or {}
    if env:
        gpu = (env.get("cuda") or {}).get("device", "none")
        lines += [
            f"Environment: {env.get('cpu')} ({env.get('cpu_count')} CPUs, {env.get('torch_threads')} torch "
            f"threads), GPU {gpu}, torch {env['versions'].get('torch')}, transformers "
            f"{env['versions'].get('transformers')}, load average at end {env.get('load_average')}.",
            "",
        ]
    if result.get("variants"):
        lines += ["## Generation (interleaved variants)", ""] + variants_table(result) + [""]
        lines += _generation_notes(result["variants"])
        for name, error in (result.get("unavailable_variants") or {}).items():
            lines += [f"- `{name}` not run: {error}"]
        if result.get("unavailable_variants"):
            lines += [""]
    if result.get("fidelity"):
        lines += ["## Fidelity", ""] + fidelity_table(result["fidelity"]) + [""]
    scale = {k: v for k, v in result.items() if k.endswith("_vs_fp32") and isinstance(v, dict)}
    if scale:
        lines += ["## Against FP32 (for scale)", ""]
        lines += markdown_table(
            ["comparison", "perplexity", "FP32 perplexity", "ratio", "top-1 agreement", "mean KL (nats)"],
            [
                [
                    k,
                    v["perplexity_model"],
                    v["perplexity_reference"],
                    v["perplexity_ratio"],
                    v["top1_agreement"],
                    v["mean_kl_nats"],
                ]
                for k, v in scale.items()
            ],
        ) + [""]
    if result.get("kernels"):
        lines += ["## Kernels", ""] + kernels_table(result["kernels"]) + [""]
    for plot in result.get("plots", []):
        lines += [f"![{os.path.basename(plot)}]({os.path.basename(plot)})", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- plots
def plot_tokens_per_s(result: dict, path: str) -> str:
    """Bar chart: median tokens/s per variant, annotated with the ratio to the BF16-verify loop."""
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    rates = [result["variants"][n]["tokens_per_s_median"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(names, rates, color=["#888" if n.startswith("bf16") else "#2a7" for n in names])
    for bar, name in zip(bars, names):
        ratio = result.get("headline", {}).get(name)
        if ratio is not None:
            ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylim(0, max(rates) * 1.15)  # headroom for the ratio labels
    ax.set_ylabel("tokens/s (median of repeats)")
    ax.set_title("Generation throughput by variant")
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_acceptance(result: dict, path: str) -> str:
    """Lines: P(draft token i accepted) by draft position, one line per speculative variant."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, s in result["variants"].items():
        per_position = s.get("acceptance_per_position")
        if per_position:
            ax.plot(range(1, len(per_position) + 1), per_position, marker="o", label=name)
    longest = max((len(s.get("acceptance_per_position") or []) for s in result["variants"].values()), default=0)
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance probability")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance by draft position")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_kernel_speedup(rows: list[dict], path: str) -> str:
    """Lines: speedup vs BF16 against M, one line per (shape, backend)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    series: dict[tuple, list[tuple[int, float]]] = {}
    for r in rows:
        if r.get("speedup_vs_bf16") is not None and r.get("backend") != "bf16":
            series.setdefault((r["shape"], r["backend"]), []).append((r["M"], r["speedup_vs_bf16"]))
    for (shape, backend), points in sorted(series.items()):
        points.sort()
        ax.plot([m for m, _ in points], [x for _, x in points], marker="o", label=f"{shape} {backend}")
    ax.axhline(1.0, color="#999", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens per call)")
    ax.set_ylabel("speedup vs BF16 linear")
    ax.set_title("W8A8 linear speedup vs M")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plots(result: dict, out_dir: str, name: str) -> tuple[list[str], str | None]:
    """Draw every plot the result has data for; (paths, error message or None)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        return [], "matplotlib is not installed: pip install matplotlib (plots skipped)"
    paths = []
    if result.get("variants"):
        paths.append(plot_tokens_per_s(result, os.path.join(out_dir, f"{name}_tokens_per_s.png")))
        if any(s.get("acceptance_per_position") for s in result["variants"].values()):
            paths.append(plot_acceptance(result, os.path.join(out_dir, f"{name}_acceptance.png")))
    if result.get("kernels"):
        paths.append(plot_kernel_speedup(result["kernels"], os.path.join(out_dir, f"{name}_kernel_speedup.png")))
    return paths, None


def write_reports(result: dict, out_dir: str, name: str = "bench", title: str | None = None) -> list[str]:
    """Write {name}.json, {name}.md and PNG plots into out_dir; return the written paths.

    Adds `environment` (unless present) and `plots` to the JSON. Does not modify `result`.
    """
    if not isinstance(result, dict):
        raise TypeError(f"result must be the dict returned by run_bench/evaluate_fidelity, got {type(result).__name__}")
    os.makedirs(out_dir, exist_ok=True)
    full = dict(result)
    full.setdefault("environment", environment())
    plots, plot_error = _plots(full, out_dir, name)
    full["plots"] = [os.path.basename(p) for p in plots]
    if plot_error:
        full["plot_error"] = plot_error
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(full, f, indent=1, default=str)
    md_path = os.path.join(out_dir, f"{name}.md")
    with open(md_path, "w") as f:
        f.write(to_markdown(full, title or f"quasar_hf {name}"))
    return [json_path, md_path, *plots]


def write_json_and_markdown(result: dict, out_dir: str | os.PathLike, name: str, render: Any) -> list[str]:
    """A measurement's report: {name}.json (with the environment block, added unless present) and {name}.md
    (`render(result)`, the measurement's own tables), written into `out_dir`; returns both paths."""
    os.makedirs(out_dir, exist_ok=True)
    full = dict(result)
    full.setdefault("environment", environment())
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(full, f, indent=1, default=str)
    md_path = os.path.join(out_dir, f"{name}.md")
    with open(md_path, "w") as f:
        f.write(render(full))
    return [json_path, md_path]
