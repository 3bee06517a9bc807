"""The prompt kernel continuing a prompt over a cache (`quasar::prefill_attention` with the queries the last Q
of N positions): accuracy against the fp64 oracle and its bits (the same rows of the whole prompt). The error
bound is test_prefill_attention.py's (the same arithmetic per row)."""

import pytest
import torch

from quasar_hf.ops import attention_cpu
from quasar_hf.ops.reference import attention_reference
from tests.test_prefill_attention import prompt_qkv

needs_kernel = pytest.mark.kernels("prefill_attention")

# (batch, heads, kv_heads, queries Q, keys N, head_dim): one row over keys of two 64-key blocks, the row count
# the dispatch starts at, Q = N - 1, ragged blocks, GQA groups 1-7, head sizes 32-256
SHAPES = [
    (2, 4, 2, 1, 70, 32), (1, 9, 3, 65, 300, 64), (1, 14, 2, 130, 131, 64), (1, 8, 8, 17, 257, 128),
    (1, 4, 1, 97, 200, 256), (2, 2, 1, 100, 301, 96), (1, 7, 1, 64, 64, 32),
]  # fmt: skip


def continuation(shape, seed=0):
    """q [B, H, Q, D] (the last Q of N positions), k/v [B, KVH, N, D] bf16 in Transformers' layout."""
    batch, heads, kv_heads, q_len, kv_len, dim = shape
    q, k, v = prompt_qkv((batch, heads, kv_heads, kv_len, dim), seed)
    return q, q[:, :, kv_len - q_len :], k, v


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_continuation_matches_the_oracle_and_the_whole_prompts_rows(shape):
    whole, q, k, v = continuation(shape)
    scale = shape[-1] ** -0.5
    out = attention_cpu.prefill_attention(q, k, v, scale)
    ref = attention_reference(q, k, v, None, scale)  # [B, Q, H, D]: row i sees keys 0 .. N - Q + i
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape and out.is_contiguous()
    err = (out.double() - ref).abs()
    assert (err <= 2.0**-9 * ref.abs() + 2.0**-7 * v.double().abs().max()).all(), err.max()
    # bit for bit the rows the kernel gives the whole prompt: a chat turn over its cache gets a fresh prefill's bits
    assert torch.equal(out, attention_cpu.prefill_attention(whole, k, v, scale)[:, -q.shape[2] :])


@needs_kernel
def test_a_continuations_rows_depend_on_their_own_keys_only():
    """A batch row alone, and one thread instead of several: the same bits."""
    _, q, k, v = continuation((2, 9, 3, 80, 250, 64), seed=1)
    both = attention_cpu.prefill_attention(q, k, v)
    for row in range(2):
        assert torch.equal(
            both[row : row + 1], attention_cpu.prefill_attention(q[row : row + 1], k[row : row + 1], v[row : row + 1])
        )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attention_cpu.prefill_attention(q, k, v), both)
    finally:
        torch.set_num_threads(threads)
