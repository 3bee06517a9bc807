"""gpu-check's report: every section of its result as markdown (errors and skips included)."""

from __future__ import annotations

from benchmarks import gpu_compiled


def to_markdown(result: dict) -> str:
    """Human-readable summary of every section present (errors included)."""
    from quasar_hf.bench.report import _table, kernels_table

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
            + _table(["measure", "value"], [[k, v] for k, v in result["attention"].items()])
            + [""]
        )
    if result.get("correctness"):
        lines += ["## Correctness vs reference", ""]
        lines += _table(
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
            lines += _table(
                ["draft tokens", "ms", "floor ms", "fraction of floor"],
                [[r["draft_tokens"], r.get("ms"), r.get("floor_ms"), r.get("fraction_of_floor")] for r in result[key]],
            ) + [""]
    if result.get("end_to_end"):
        lines += ["## End to end (n-gram drafts, random weights)", ""]
        lines += _table(
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
        lines += ["## Targets", ""] + _table(["target", "measured"], [[k, v] for k, v in result["targets"].items()]) + [""]
    if result.get("errors"):
        lines += ["## Errors", ""] + [f"- **{k}**: `{v.splitlines()[-1]}`" for k, v in result["errors"].items()] + [""]
        lines += ["Full tracebacks: `errors` in gpu_check.json.", ""]
    return "\n".join(lines)


def user_path_markdown(user: dict | None) -> list[str]:
    """The user-path section: quantize, reload, and each generation comparison."""
    from quasar_hf.bench.report import _table

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
        lines += _table(["generate", "quasar = plain", "per row", "new tokens", "plain s", "quasar s"], rows) + [""]
    return lines
