"""gpu-check's report: every section of its result as markdown (errors and skips included)."""

from __future__ import annotations

from benchmarks.gpu import gpu_compiled
from benchmarks.gpu.gpu_profile import profile_markdown


def to_markdown(result: dict) -> str:
    """Human-readable summary of every section present (errors included)."""
    from quasar_hf.bench.report import kernels_table, markdown_table

    env = result.get("environment", {})
    lines = [
        "# quasar_hf GPU check",
        "",
        f"Command: `{result.get('command')}`",
        "",
        f"Device: {(env.get('cuda') or {}).get('device', 'cpu')}; torch {env.get('versions', {}).get('torch')}, "
        f"triton {env.get('versions', {}).get('triton')}, transformers {env.get('versions', {}).get('transformers')}; "
        f"wall time {result.get('wall_s', 0):.0f} s.",
        "",
    ]
    lines += user_path_markdown(result.get("user_path"))
    bw = result.get("bandwidth")
    if bw:
        lines += [f"Measured copy bandwidth: {bw['gbps']:.0f} GB/s.", ""]
    if result.get("attention"):
        lines += (
            ["## Row-stable attention", ""]
            + markdown_table(["measure", "value"], [[k, v] for k, v in result["attention"].items()])
            + [""]
        )
    if result.get("correctness"):
        lines += ["## Correctness vs reference", ""]
        lines += markdown_table(
            ["phase", "M", "backend", "max rel err", "bit-exact fraction", "ok / error"],
            [
                [r["phase"], r["M"], r["backend"], r.get("max_rel_err"), r.get("bit_exact_fraction"), r.get("error", r.get("ok"))]
                for r in result["correctness"]
            ],
        ) + [""]
    if result.get("kernels"):
        lines += ["## Kernels", ""] + kernels_table([r for r in result["kernels"] if "time_us" in r]) + [""]
    for key in ("verify_bf16", "verify_w8a8"):
        if result.get(key):
            lines += [f"## Verify step ({key.split('_')[1].upper()})", ""]
            lines += markdown_table(
                ["draft tokens", "ms", "floor ms", "fraction of floor"],
                [[r["draft_tokens"], r.get("ms"), r.get("floor_ms"), r.get("fraction_of_floor")] for r in result[key]],
            ) + [""]
    lines += profile_markdown(result)
    if result.get("end_to_end"):
        lines += ["## End to end (n-gram drafts, random weights)", ""]
        lines += markdown_table(
            ["variant", "tokens/s", "L", "ms / verify step"],
            [
                [
                    n,
                    s["tokens_per_s_median"],
                    s.get("mean_acceptance_length"),
                    s["time_per_verify_step_s"] * 1e3 if s.get("time_per_verify_step_s") else None,
                ]
                for n, s in result["end_to_end"].items()
            ],
        ) + [""]
    lines += gpu_compiled.markdown(result)
    if result.get("targets"):
        lines += (
            ["## Targets", ""] + markdown_table(["target", "measured"], [[k, v] for k, v in result["targets"].items()]) + [""]
        )
    if result.get("errors"):
        lines += ["## Errors", ""] + [f"- **{k}**: `{v.splitlines()[-1]}`" for k, v in result["errors"].items()] + [""]
        lines += ["Full tracebacks: `errors` in gpu_check.json.", ""]
    return "\n".join(lines)


def user_path_markdown(user: dict | None) -> list[str]:
    """The user-path section: quantize, reload, and each generation comparison."""
    from quasar_hf.bench.report import markdown_table

    if not user:
        return []
    quantize, reload = user.get("quantize") or {}, user.get("save_reload") or {}
    lines = [
        "## What a user does first (random-weight Llama, real tokenizer)",
        "",
        f"Quantized through `from_pretrained(..., quantization_config=QuasarConfig(), device_map={user['device']!r})` "
        f"in {quantize.get('seconds')} s, calibrated on {quantize.get('calibrated_on')} ({quantize.get('math_dtype')}); "
        f"saved and reloaded: identical logits {reload.get('identical_logits')}.",
        "",
    ]
    rows = [
        [k, v["equal"], v["equal_rows"], v["new_tokens"], v["plain_s"], v["quasar_s"]]
        for k, v in (user.get("generate") or {}).items()
    ]
    if rows:
        lines += markdown_table(["generate", "quasar = plain", "per row", "new tokens", "plain s", "quasar s"], rows) + [""]
    return lines


def check_targets(result: dict) -> dict:
    """The H200 acceptance targets against this run (None where the inputs are missing)."""
    kernels = [
        r
        for r in result.get("kernels") or []
        if r.get("backend") == "triton" and r.get("M", 99) <= 16 and "time_us" in r and "qwen3" in r.get("shape", "")
    ]
    verify = {r["draft_tokens"]: r for r in (result.get("verify_bf16") or []) if "ms" in r}
    verify_q = {r["draft_tokens"]: r for r in (result.get("verify_w8a8") or []) if "ms" in r}
    ratios = [verify[k]["ms"] / verify_q[k]["ms"] for k in verify if k in verify_q]
    e2e = result.get("end_to_end") or {}
    e2e_ratio = None
    if "bf16_verify_ngram" in e2e and "quasar_ngram" in e2e:
        e2e_ratio = e2e["quasar_ngram"]["tokens_per_s_median"] / e2e["bf16_verify_ngram"]["tokens_per_s_median"]
    attention = result.get("attention") or {}
    attention_ratios = [
        attention[f"us_rows{rows}_kernel"] / attention[f"us_rows{rows}_sdpa"]
        for rows in (1, 6)
        if attention.get(f"us_rows{rows}_kernel") and attention.get(f"us_rows{rows}_sdpa")
    ]
    w8a8_ops = (result.get("profile_w8a8") or {}).get("quasar_ops") or {}
    host_us = [op["host_us_per_call"] for name, op in w8a8_ops.items() if name.startswith("quasar::w8a8")]
    return {
        **gpu_compiled.compiled_targets(result),
        "attention_max_time_vs_sdpa (target <= 1.3)": max(attention_ratios, default=None),
        "eager_host_us_per_w8a8_call (target <= 50)": max(host_us, default=None),
        "triton_min_speedup_m_le_16 (target >= 1.7)": min((r["speedup_vs_bf16"] for r in kernels), default=None),
        "triton_min_fraction_of_copy_bw_m_le_16 (target >= 0.75)": min((r["fraction_of_copy_bw"] for r in kernels), default=None),
        "verify_step_min_speedup (target >= 1.6)": min(ratios, default=None),
        "end_to_end_speedup_vs_bf16_verify (target >= 1.4)": e2e_ratio,
    }
