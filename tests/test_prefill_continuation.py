"""The prompt kernel continuing a prompt over a cache (`quasar::prefill_attention` with the queries the last Q
of N positions): accuracy against the fp64 oracle, its bits (the same rows of the whole prompt), and which calls
`rowstable_attention_forward` sends to it: a long continuation whose mask is exactly bottom-right causal, never
a batch with holes or padding, a window, or q_len <= LONG_PREFILL_ROWS (verification rows, which must equal
decode steps). The error bound is test_prefill_attention.py's (the same arithmetic per row)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401  (registers quant_method "quasar")
from quasar_hf import QuasarConfig, compat
from quasar_hf.ops import attention_cpu, rowstable_attention
from quasar_hf.ops.reference import attention_reference
from quasar_hf.ops.rowstable_attention import LONG_PREFILL_ROWS
from tests.helpers.tiny_models import save_tiny
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


def bottom_right(batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """SDPA's bool mask [B, 1, Q, N] of a continuation over a cache: row i sees keys 0 .. N - Q + i."""
    rows = torch.arange(kv_len - q_len, kv_len)[:, None]
    return (torch.arange(kv_len)[None, :] <= rows).expand(batch, 1, q_len, kv_len).clone()


def prompt_calls(monkeypatch) -> list[tuple[int, int]]:
    """(queries, keys) of every call the prompt kernel computes from now on."""
    calls = []
    real = attention_cpu.prefill_attention
    monkeypatch.setattr(
        attention_cpu, "prefill_attention", lambda q, k, *a: calls.append((q.shape[2], k.shape[2])) or real(q, k, *a)
    )
    return calls


class _Causal(torch.nn.Module):
    is_causal = True


@needs_kernel
def test_the_dispatch_sends_a_long_causal_continuation_and_nothing_else(monkeypatch):
    calls = prompt_calls(monkeypatch)
    module, q_len, kv_len = _Causal(), 100, 300
    whole, q, k, v = continuation((2, 4, 2, q_len, kv_len, 64), seed=2)
    mask = bottom_right(2, q_len, kv_len)
    forward = rowstable_attention.rowstable_attention_forward
    out, _ = forward(module, q, k, v, mask, scaling=0.125)
    assert calls == [(q_len, kv_len)]
    assert torch.equal(out, attention_cpu.prefill_attention(whole, k, v, 0.125)[:, -q_len:])
    calls.clear()
    rowstable = lambda q, k, v, m: torch.ops.quasar.rowstable_attention(q, k, v, m[:, 0, :, : k.shape[2]], 0.125)  # noqa: E731
    holes = mask.clone()
    holes[1, :, :, :3] = False  # the second row's padding: a batch of rows of different lengths
    one_hole = mask.clone()
    one_hole[0, :, :, 150] = False  # a hole inside the cache
    swapped = mask.clone()
    swapped[0, :, 10, 5], swapped[0, :, 10, kv_len - q_len + 11] = False, True  # a hole and a future key: same count
    window = mask & (torch.arange(kv_len) > torch.arange(kv_len - q_len, kv_len)[:, None] - 250)  # a 250-key window
    short = bottom_right(2, LONG_PREFILL_ROWS, kv_len)
    cases = [(q, holes), (q, one_hole), (q, swapped), (q, window), (q[:, :, -LONG_PREFILL_ROWS:], short)]
    for query, case in cases:
        out, _ = forward(module, query, k, v, case, scaling=0.125)
        assert torch.equal(out, rowstable(query, k, v, case))  # the row-stable kernel, as before
    # the mask's keys past N (a static cache's longer mask) do not count; a window kwarg shorter than N does
    longer = torch.cat([bottom_right(2, q_len, kv_len - 1), torch.zeros(2, 1, q_len, 1, dtype=torch.bool)], dim=-1)
    forward(module, q, k[:, :, :-1], v[:, :, :-1], longer, scaling=0.125)
    forward(module, q, k, v, mask, scaling=0.125, sliding_window=kv_len - 1)
    assert calls == [(q_len, kv_len - 1)]
    out, _ = forward(module, q, k, v, mask, scaling=0.125, quasar_rowstable=True)  # a verify call of many drafts
    assert calls == [(q_len, kv_len - 1)] and torch.equal(out, rowstable(q, k, v, mask))


@pytest.fixture(scope="module")
def qwen3_w8a8(tmp_path_factory):
    """A tiny Qwen3 (head size 128) quantized in bf16: its long prompts can take the kernel."""
    path = save_tiny(tmp_path_factory.mktemp("qwen3"), "qwen3", dtype=torch.bfloat16)
    config = QuasarConfig(alpha=0.5, num_calibration_samples=4, calibration_seq_len=64)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.bfloat16).eval()


@needs_kernel
def test_a_long_turn_over_an_earlier_turns_cache_takes_the_kernel_and_quasar_equals_plain(qwen3_w8a8, monkeypatch):
    model, layers = qwen3_w8a8, qwen3_w8a8.config.num_hidden_layers
    base = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(4))
    first = model.generate(torch.cat([base, base])[None], max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    turn_2 = torch.cat([first.sequences, torch.cat([base, base[:40]])[None]], dim=1)  # 80 new tokens, repeating
    cached = first.sequences.shape[1] - 1  # generate's cache holds every token but the last one emitted
    calls = prompt_calls(monkeypatch)

    def greedy(quasar):
        cache = {compat.cache_argument_name(model): copy.deepcopy(first.past_key_values)}
        return model.generate(turn_2, max_new_tokens=20, do_sample=False, quasar=quasar, return_dict_in_generate=True, **cache)

    plain = greedy(False)
    assert calls == [(turn_2.shape[1] - cached, turn_2.shape[1])] * layers  # the turn's new tokens over the cache
    ours = greedy(True)
    assert calls == [(turn_2.shape[1] - cached, turn_2.shape[1])] * 2 * layers and ours.quasar_stats.verify_steps > 0
    assert torch.equal(ours.sequences, plain.sequences)


@needs_kernel
def test_a_verify_call_of_many_drafts_keeps_the_row_stable_kernel(qwen3_w8a8, monkeypatch):
    """num_draft_tokens > LONG_PREFILL_ROWS: verify calls as long as a chat turn's prompt, whose rows must equal decode
    steps, never reach the prompt kernel; only the prompt does."""
    model, layers = qwen3_w8a8, qwen3_w8a8.config.num_hidden_layers
    calls, long_rows = prompt_calls(monkeypatch), []
    real = rowstable_attention._attention_op

    def row_stable(q, k, *args):
        if LONG_PREFILL_ROWS < q.shape[2] < k.shape[2]:
            long_rows.append(q.shape[2])
        return real(q, k, *args)

    monkeypatch.setattr(rowstable_attention, "_attention_op", row_stable)
    base = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(1))
    prompt = torch.cat([base] * 4)[None]  # repeating: the n-gram drafter proposes long drafts
    plain = model.generate(prompt, max_new_tokens=200, do_sample=False)
    spec = model.generate(prompt, max_new_tokens=200, do_sample=False, quasar={"drafter": "ngram", "num_draft_tokens": 80})
    assert long_rows and calls == [(prompt.shape[1], prompt.shape[1])] * 2 * layers
    assert torch.equal(spec, plain)
