"""Interleaved runner and reports, on tiny random models (one fp32, one with W8A8Linear layers)."""

import copy
import json
import os

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from quasar_hf.bench.report import environment, to_markdown, write_reports
from quasar_hf.bench.runner import BASELINE, PeakMemory, build_variants, run_bench
from quasar_hf.nn import W8A8Linear


class CharTokenizer:
    chat_template = None
    eos_token_id = 1

    def __call__(self, text):
        return {"input_ids": [ord(c) % 60 + 2 for c in text]}


def tiny_pair():
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        eos_token_id=1,
        bos_token_id=None,
    )
    reference = AutoModelForCausalLM.from_config(config).eval()
    quantized = copy.deepcopy(reference)
    for name, module in list(quantized.model.layers.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(quantized.model.layers.get_submodule(parent), child, W8A8Linear.from_linear(module, backend="reference"))
    return reference, quantized


PROMPTS = [
    {"id": "p0", "suite": "t", "version": 1, "prompt": "abc abd abc abd abc ab"},
    {"id": "p1", "suite": "t", "version": 1, "prompt": "the cat the cat the c"},
]


@pytest.fixture(scope="module")
def bench_result():
    reference, quantized = tiny_pair()
    return run_bench(
        reference,
        quantized,
        CharTokenizer(),
        prompts=PROMPTS,
        max_new_tokens=12,
        repeats=2,
        warmup=0,
        num_draft_tokens=3,
    )


def test_every_variant_runs_on_every_prompt_every_repeat(bench_result):
    runs = bench_result["runs"]
    names = bench_result["config"]["variants"]
    assert len(runs) == len(names) * len(PROMPTS) * 2
    # interleaving: the first variant to run changes from one prompt to the next
    firsts = [runs[i * len(names)]["variant"] for i in range(len(PROMPTS) * 2)]
    assert len(set(firsts)) > 1


def test_greedy_bf16_variants_emit_identical_tokens(bench_result):
    for name in ("bf16_prompt_lookup", BASELINE):
        assert bench_result["variants"][name]["same_tokens_as_bf16_generate"] == 1.0


def test_summaries_hold_rates_acceptance_and_headline(bench_result):
    base = bench_result["variants"][BASELINE]
    assert base["tokens_per_s_median"] > 0 and base["mean_acceptance_length"] >= 1.0
    assert all(0.0 <= p <= 1.0 for p in base["acceptance_per_position"])
    assert bench_result["headline"][BASELINE] == pytest.approx(1.0)
    assert set(bench_result["headline"]) == set(bench_result["variants"])
    assert bench_result["variants"]["quasar_ngram"]["time_per_verify_step_s"] > 0


def test_write_reports_json_markdown_and_plots(bench_result, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (plots)")
    result = dict(
        bench_result,
        command="pytest",
        kernels=[
            {"shape": "s", "M": m, "backend": "torch", "time_us": 10.0 / m, "speedup_vs_bf16": 1.0 + m / 8} for m in (1, 4, 16)
        ],
    )
    paths = write_reports(result, str(tmp_path), "t")
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["t.json", "t.md", "t_acceptance.png", "t_kernel_speedup.png", "t_tokens_per_s.png"]
    data = json.loads((tmp_path / "t.json").read_text())
    assert torch.__version__.startswith(data["environment"]["versions"]["torch"])
    assert data["plots"] == ["t_tokens_per_s.png", "t_acceptance.png", "t_kernel_speedup.png"]
    md = (tmp_path / "t.md").read_text()
    assert "| quasar_ngram |" in md and "x vs bf16_verify_ngram" in md and "t_tokens_per_s.png" in md
    assert all((tmp_path / n).stat().st_size > 1000 for n in names if n.endswith(".png"))


def test_environment_and_fidelity_markdown():
    env = environment()
    assert env["cpu_count"] >= 1 and env["versions"]["torch"]
    md = to_markdown(
        {
            "fidelity": {
                "next_token": {
                    "perplexity_model": 10.1,
                    "perplexity_reference": 10.0,
                    "perplexity_ratio": 1.01,
                    "top1_agreement": 0.95,
                    "mean_kl_nats": 0.01,
                    "tokens_evaluated": 100,
                }
            }
        }
    )
    assert "| perplexity ratio | 1.010 |" in md


def test_peak_memory_sees_a_large_allocation():
    with PeakMemory("cpu") as memory:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB
        del block
    assert memory.peak_bytes is None or memory.peak_bytes > 64 * 2**20


def test_bad_arguments_raise_clear_errors(tmp_path):
    reference, quantized = tiny_pair()
    with pytest.raises(ValueError, match="unknown variant"):
        build_variants(["turbo"], reference, quantized)
    with pytest.raises(ValueError, match="quantized_model"):
        build_variants(["quasar_ngram"], reference, None)
    with pytest.raises(ValueError, match="repeats"):
        run_bench(reference, quantized, CharTokenizer(), prompts=PROMPTS, repeats=0)
    with pytest.raises(TypeError, match="result"):
        write_reports([1, 2], tmp_path / "unused")


def test_a_variant_that_cannot_run_is_reported_not_fatal():
    reference, quantized = tiny_pair()
    result = run_bench(
        reference,
        quantized,
        CharTokenizer(),
        prompts=PROMPTS[:1],
        max_new_tokens=4,
        repeats=1,
        warmup=0,
        variants=[BASELINE, "quasar_ngram", "quasar_self"],
    )
    assert "quasar_self" in result["unavailable_variants"] and "ngram" in result["unavailable_variants"]["quasar_self"]
    assert set(result["variants"]) == {BASELINE, "quasar_ngram"}
    assert "`quasar_self` not run" in to_markdown(result)


def test_acceptance_length_ratio_pools_prompts_and_brackets_the_estimate(bench_result):
    from quasar_hf.bench.runner import acceptance_length_ratio

    def run(variant, prompt, emitted, steps):
        return {
            "variant": variant,
            "prompt_index": prompt,
            "repeat": 0,
            "stats": {"new_tokens": emitted, "verify_steps": steps},
        }

    # Pooled L: baseline (10 + 30) / (10 + 10) = 2.0, variant (12 + 30) / (10 + 10) = 2.1.
    runs = [run(BASELINE, 0, 10, 10), run(BASELINE, 1, 30, 10), run("quasar_ngram", 0, 12, 10), run("quasar_ngram", 1, 30, 10)]
    out = acceptance_length_ratio(runs, "quasar_ngram")
    assert out["ratio"] == pytest.approx(1.05) and out["prompts"] == 2
    low, high = out["ci95"]
    assert low <= out["ratio"] <= high and high > low  # prompts disagree (1.2 vs 1.0): a real interval
    assert acceptance_length_ratio(runs, "quasar_other") is None
    reported = bench_result["variants"]["quasar_ngram"]["L_ratio_vs_baseline"]
    assert reported["prompts"] == len(PROMPTS) and reported["ci95"][0] <= reported["ratio"] <= reported["ci95"][1]
    assert "paired bootstrap 95% interval" in to_markdown(bench_result)
