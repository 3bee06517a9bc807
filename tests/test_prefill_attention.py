"""The prompt kernel (`quasar::prefill_attention`, whichever build runs here): accuracy against the fp64 oracle, the
bits it keeps (batch rows, prompt prefixes, thread counts), and which calls a model sends to it.

Error bound, from the kernel's arithmetic (csrc/prefill_attention_bf16.c): scores are fp32 sums of exact
bf16 products (error ~D * 2^-24, negligible); each softmax weight is rounded to bf16 (relative 2^-9) and
the row normalised by the sum of the rounded weights, so the output is a convex combination of the
values with weights off by at most ~2^-8 relative: |out - ref| <= 2^-8 * max|v|; the bf16 output adds
2^-9 |ref|. The test allows twice the first term.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401  (registers quant_method "quasar")
from quasar_hf import QuasarConfig
from quasar_hf.ops import attention_cpu, rowstable_attention
from quasar_hf.ops.reference import attention_reference
from tests.helpers.tiny_models import save_tiny

needs_kernel = pytest.mark.kernels("prefill_attention")

# (batch, heads, kv_heads, length, head_dim): one token, ragged blocks (16-row query blocks, 64-key
# blocks), GQA group sizes 1-7, the head sizes of SmolLM2 / Qwen2.5 (64), Qwen3 (128), Gemma 3 (256), 96
SHAPES = [
    (1, 4, 2, 1, 32), (2, 4, 2, 5, 64), (1, 9, 3, 63, 64), (1, 9, 3, 64, 64), (2, 9, 3, 65, 64),
    (1, 14, 2, 130, 64), (1, 8, 8, 200, 128), (1, 4, 1, 97, 256), (2, 2, 1, 300, 96),
]  # fmt: skip


def prompt_qkv(shape, seed=0):
    """q [B, H, L, D], k/v [B, KVH, L, D] in bf16, laid out as Transformers passes them (the head axis
    transposed out of [B, L, H, D]); q scaled so that some rows' softmax is peaked."""
    batch, heads, kv_heads, length, dim = shape
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, length, heads, dim, generator=g) * 2).bfloat16().transpose(1, 2)
    k = torch.randn(batch, length, kv_heads, dim, generator=g).bfloat16().transpose(1, 2)
    v = torch.randn(batch, length, kv_heads, dim, generator=g).bfloat16().transpose(1, 2)
    return q, k, v


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_the_fp64_oracle_within_its_bound(shape):
    q, k, v = prompt_qkv(shape)
    scale = shape[-1] ** -0.5
    out = attention_cpu.prefill_attention(q, k, v, scale)
    ref = attention_reference(q, k, v, None, scale)  # [B, L, H, D], causal
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape and out.is_contiguous()
    err = (out.double() - ref).abs()
    assert (err <= 2.0**-9 * ref.abs() + 2.0**-7 * v.double().abs().max()).all(), err.max()
    # and no worse than what runs without the kernel: torch's SDPA in bf16
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)
    rms = lambda x: (x.double() - ref).pow(2).mean().sqrt().item()  # noqa: E731
    assert rms(out) <= 1.25 * rms(sdpa) + 1e-6


@needs_kernel
def test_a_row_depends_on_its_own_prompt_only():
    """Bit for bit: a batched prompt equals it alone, a prompt's first n rows equal the kernel on its first
    n tokens (keys past a row never enter its sums), and the thread count changes nothing."""
    q, k, v = prompt_qkv((2, 9, 3, 150, 64))
    both = attention_cpu.prefill_attention(q, k, v)
    for row in range(2):
        alone = attention_cpu.prefill_attention(q[row : row + 1], k[row : row + 1], v[row : row + 1])
        assert torch.equal(both[row : row + 1], alone)
    for n in (1, 17, 64, 100):
        prefix = attention_cpu.prefill_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n])
        assert torch.equal(prefix, both[:, :n])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = attention_cpu.prefill_attention(q, k, v)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, both)


def test_inputs_it_does_not_take_are_refused_with_the_alternative():
    q, k, v = prompt_qkv((1, 4, 2, 8, 64))
    cases = [
        (q.float(), k.float(), v.float()),  # float32
        (q[..., :48], k[..., :48], v[..., :48]),  # head size not a multiple of 32
        (q, k[:, :, :6], v[:, :, :6]),  # fewer keys than queries: not a prompt
    ]
    for args in cases:
        assert not attention_cpu.prefill_supports(*args)
        with pytest.raises(ValueError, match="scaled_dot_product_attention"):
            attention_cpu.prefill_attention(*args)


@pytest.fixture(scope="module")
def qwen3_w8a8(tmp_path_factory):
    """A tiny Qwen3 (head size 128) quantized in bf16: its long prefills can take the kernel."""
    path = save_tiny(tmp_path_factory.mktemp("qwen3"), "qwen3", dtype=torch.bfloat16)
    config = QuasarConfig(alpha=0.5, num_calibration_samples=4, calibration_seq_len=64)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.bfloat16).eval()


def prompt_calls(monkeypatch) -> list[int]:
    """The lengths of the prompts the kernel computes from now on (one entry per layer call)."""
    calls = []
    real = attention_cpu.prefill_attention
    monkeypatch.setattr(attention_cpu, "prefill_attention", lambda q, *a: calls.append(q.shape[2]) or real(q, *a))
    return calls


@needs_kernel
def test_long_prefills_take_the_kernel_and_greedy_quasar_still_equals_plain(qwen3_w8a8, monkeypatch):
    model, layers = qwen3_w8a8, qwen3_w8a8.config.num_hidden_layers
    calls = prompt_calls(monkeypatch)
    base = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1))
    prompt = torch.cat([base, base, base[:20]])[None]  # 100 tokens, repeating: n-gram drafts get accepted
    plain = model.generate(prompt, max_new_tokens=24, do_sample=False, quasar=False)
    assert calls == [100] * layers  # the prefill; decode steps and short prompts run the row-stable kernel
    spec = model.generate(prompt, max_new_tokens=24, do_sample=False, quasar=True, return_dict_in_generate=True)
    assert spec.quasar_stats.verify_steps > 0 and calls == [100] * 2 * layers
    assert torch.equal(spec.sequences, plain)
    calls.clear()
    padded = torch.cat([torch.full((1, 30), 96), prompt[:, :70]], dim=1)  # a left-padded batch: each row alone
    ids = torch.cat([prompt, padded])
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, quasar=False)
    assert sorted(calls) == sorted([100, 70] * layers)


def test_without_the_kernel_prefills_run_sdpa(qwen3_w8a8, monkeypatch):
    """Where no build of the kernel runs (made so here), the same prefill runs SDPA: no call, same shapes."""
    calls = prompt_calls(monkeypatch)
    monkeypatch.setattr(attention_cpu, "prefill_unavailable_reason", lambda: "no avx512_bf16 (test)")
    prompt = torch.randint(0, 96, (1, rowstable_attention.LONG_PREFILL_ROWS + 20))
    logits = qwen3_w8a8(prompt).logits
    assert calls == [] and torch.isfinite(logits).all()


@needs_kernel
def test_prefills_the_kernel_cannot_express_run_sdpa(qwen3_w8a8, monkeypatch):
    """A sliding window shorter than the prompt, or a non-causal module: SDPA, never the kernel."""
    calls = prompt_calls(monkeypatch)
    q, k, v = prompt_qkv((1, 4, 2, 100, 128))
    module = qwen3_w8a8.model.layers[0].self_attn
    rowstable_attention.rowstable_attention_forward(module, q, k, v, None, scaling=0.1, sliding_window=50)
    assert calls == []
    rowstable_attention.rowstable_attention_forward(module, q, k, v, None, scaling=0.1, sliding_window=100)
    assert calls == [100]  # a window that covers the prompt changes nothing
    monkeypatch.setattr(module, "is_causal", False)
    rowstable_attention.rowstable_attention_forward(module, q, k, v, None, scaling=0.1)
    assert calls == [100]


def test_a_short_row_of_a_long_padded_batch_gets_the_bits_it_gets_alone(qwen3_w8a8):
    """A left-padded batch's long prefill runs each row as that request alone runs: a row of 30 tokens beside
    one of 100 takes the row-stable kernel (a short prompt's path alone), not the long-prompt attention."""
    model = qwen3_w8a8
    gen = torch.Generator().manual_seed(3)
    long_prompt, short_prompt = torch.randint(0, 96, (1, 100), generator=gen), torch.randint(0, 96, (1, 30), generator=gen)
    ids = torch.cat([long_prompt, torch.cat([torch.full((1, 70), 96), short_prompt], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :70] = 0
    with torch.inference_mode():
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers a left-padded row
        batched = model(ids, attention_mask=mask, position_ids=positions).logits[1, -1]
        alone = model(short_prompt).logits[0, -1]
    assert torch.equal(batched, alone)
