"""Row-stable CPU attention kernel: accuracy against the fp64 oracle, and row stability (bit for bit)."""

import pytest
import torch

from quasar_hf.ops import attention_cpu
from quasar_hf.ops.reference import attention_reference

pytestmark = pytest.mark.kernels("attention")

DTYPES = [torch.float32, torch.bfloat16]
# (batch, heads, kv_heads, q_len, kv_len, head_dim): decode, verification, GQA, MHA, ragged head dims
SHAPES = [
    (1, 9, 3, 1, 40, 64), (1, 9, 3, 6, 300, 64), (2, 4, 2, 5, 37, 20), (1, 2, 2, 3, 3, 72), (3, 6, 1, 17, 50, 16),
    (1, 4, 1, 3, 33, 128), (1, 4, 1, 2, 20, 256),  # Qwen3 and Gemma 3 head sizes
    (1, 14, 2, 6, 50, 64), (2, 8, 2, 3, 45, 64),  # Qwen2.5 0.5B's 7 heads per kv head (two blocks); batch 2
]  # fmt: skip


def qkv(shape, dtype, seed=0):
    batch, heads, kv_heads, q_len, kv_len, dim = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=g) * 2  # peaked softmax as well as flat ones
    k = torch.randn(batch, kv_heads, kv_len, dim, generator=g)
    v = torch.randn(batch, kv_heads, kv_len, dim, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_visible(batch, q_len, kv_len, seed=0):
    """Causal (bottom-right) with random holes (left padding, rejected drafts), every row sees >= 1 key."""
    g = torch.Generator().manual_seed(seed)
    causal = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
    holes = torch.rand(batch, q_len, kv_len, generator=g) < 0.3
    visible = causal[None] & ~holes
    visible[:, :, 0] = True
    return visible


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_fp64_reference(shape, dtype):
    q, k, v = qkv(shape, dtype)
    for visible in (None, random_visible(shape[0], shape[3], shape[4])):
        out = attention_cpu.rowstable_attention(q, k, v, visible, scale=0.125)
        ref = attention_reference(q, k, v, visible, scale=0.125)
        assert out.dtype == dtype and out.shape == ref.shape
        err = (out.double() - ref).abs()
        if dtype == torch.float32:  # fp32 accumulation over <= 300 keys
            assert float(err.max()) <= 2e-6 * max(1.0, float(ref.abs().max()))
        else:  # bf16 inputs are exact in fp32: the error is the output's rounding (half an ulp) + fp32 noise
            assert bool((err <= ref.abs() * 2.0**-8 + 1e-6).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_each_row_equals_that_row_alone_on_the_keys_it_sees(shape, dtype):
    """The property verification relies on: row i of a Q-row call == a 1-row decode call, bit for bit."""
    q, k, v = qkv(shape, dtype, seed=1)
    q_len, kv_len = shape[3], shape[4]
    together = attention_cpu.rowstable_attention(q, k, v)
    for i in range(q_len):
        end = kv_len - q_len + i + 1  # the decode step at this position has exactly these keys
        alone = attention_cpu.rowstable_attention(q[:, :, i : i + 1], k[:, :, :end], v[:, :, :end])
        assert torch.equal(alone[:, 0], together[:, i]), f"row {i}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_keys_change_nothing_and_masks_equal_causal(dtype):
    shape = (2, 4, 2, 4, 30, 64)
    q, k, v = qkv(shape, dtype, seed=2)
    visible = random_visible(2, 4, 30, seed=3)
    base = attention_cpu.rowstable_attention(q, k, v, visible)
    # Extra keys nobody may see (a longer cache with rejected slots) leave every row's bits alone.
    k2 = torch.cat([k, torch.randn_like(k[:, :, :7])], dim=2)
    v2 = torch.cat([v, torch.randn_like(v[:, :, :7])], dim=2)
    visible2 = torch.cat([visible, torch.zeros(2, 4, 7, dtype=torch.bool)], dim=2)
    q2 = q  # same rows, now over 37 keys
    assert torch.equal(attention_cpu.rowstable_attention(q2, k2, v2, visible2), base)
    # An explicit causal mask gives the same bits as None.
    causal = (torch.arange(30)[None, :] <= torch.arange(4)[:, None] + 26).expand(2, 4, 30)
    assert torch.equal(attention_cpu.rowstable_attention(q, k, v, causal), attention_cpu.rowstable_attention(q, k, v))


@pytest.mark.parametrize("written", [41, 48, 3])
def test_a_static_cache_mask_over_unwritten_slots_equals_the_written_keys_alone(written):
    """What a compiled step passes: causal rows over `written` slots of a 70-slot cache, the rest masked
    (whole 8-byte mask words of zeros and of ones, and ragged ones): the bits of attention over the
    written keys with no mask."""
    q_len = 3
    q, k, v = qkv((1, 4, 2, q_len, 70, 64), torch.bfloat16, seed=11)
    visible = torch.zeros(1, q_len, 70, dtype=torch.bool)
    for i in range(q_len):
        visible[0, i, : written - q_len + i + 1] = True
    alone = attention_cpu.rowstable_attention(q, k[:, :, :written], v[:, :, :written])
    assert torch.equal(attention_cpu.rowstable_attention(q, k, v, visible), alone)


def test_thread_count_does_not_change_bits():
    q, k, v = qkv((2, 8, 2, 6, 120, 64), torch.bfloat16, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention_cpu.rowstable_attention(q, k, v)
        torch.set_num_threads(max(2, threads))
        many = attention_cpu.rowstable_attention(q, k, v)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_edge_rows_zero_keys_nan_and_noncontiguous_inputs():
    q, k, v = qkv((1, 2, 1, 3, 8, 16), torch.float32, seed=7)
    visible = torch.ones(1, 3, 8, dtype=torch.bool)
    visible[0, 1] = False  # a row that may see nothing (a padding row) gets zeros, not NaN
    out = attention_cpu.rowstable_attention(q, k, v, visible)
    assert torch.equal(out[0, 1], torch.zeros(2, 16)) and bool(torch.isfinite(out).all())
    q_nan = q.clone()
    q_nan[0, 0, 2, 3] = float("nan")
    out = attention_cpu.rowstable_attention(q_nan, k, v)
    assert bool(out[0, 2, 0].isnan().all()) and bool(torch.isfinite(out[0, :2]).all())
    # [B, Q, H, D] memory viewed as [B, H, Q, D] (what q_proj(...).view().transpose() gives)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(attention_cpu.rowstable_attention(q_t, k, v), attention_cpu.rowstable_attention(q, k, v))


def test_bad_inputs_raise_clear_errors():
    q, k, v = qkv((1, 4, 2, 2, 8, 16), torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        attention_cpu.rowstable_attention(q.half(), k.half(), v.half())
    with pytest.raises(ValueError, match="divisible"):
        attention_cpu.rowstable_attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="at least as many keys"):
        attention_cpu.rowstable_attention(q, k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="visible must be a bool tensor"):
        attention_cpu.rowstable_attention(q, k, v, torch.ones(1, 2, 7, dtype=torch.bool))
    assert not attention_cpu.supports(q.half(), k.half(), v.half())
