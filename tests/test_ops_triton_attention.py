"""Row-stable Triton attention: accuracy and row stability in the interpreter, sm_90 compile ahead of time."""

import os

import pytest
import torch

from quasar_hf.ops.reference import attention_reference
from tests.helpers.triton_aot import hopper_ptx, run_outside_the_interpreter

triton = pytest.importorskip("triton", reason="triton is not installed")
from quasar_hf.ops import triton_attention  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
runs_kernels = pytest.mark.skipif(
    not INTERPRETED and not torch.cuda.is_available(), reason="running the kernel needs a CUDA device or TRITON_INTERPRET=1"
)
# (batch, heads, kv_heads, q_len, kv_len, head_dim): decode, verify, MHA, ragged head dim, M = 1 over 1 key,
# and rows over 3 chunks (the interpreter's chunk is 32 keys: one chunk, two, and three are all exercised)
SHAPES = [(1, 4, 2, 1, 21, 16), (1, 4, 2, 6, 37, 16), (2, 2, 2, 3, 19, 20), (1, 2, 1, 1, 1, 8), (1, 4, 2, 5, 70, 16)]


def qkv(shape, dtype, seed=0):
    batch, heads, kv_heads, q_len, kv_len, dim = shape
    g = torch.Generator().manual_seed(seed)
    tensors = (
        torch.randn(batch, heads, q_len, dim, generator=g) * 2,
        torch.randn(batch, kv_heads, kv_len, dim, generator=g),
        torch.randn(batch, kv_heads, kv_len, dim, generator=g),
    )
    return [t.to(dtype).to(DEVICE) for t in tensors]


def holes(batch, q_len, kv_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    causal = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)
    visible = causal[None] & (torch.rand(batch, q_len, kv_len, generator=g) > 0.3)
    visible[:, :, 0] = True
    return visible.to(DEVICE)


@runs_kernels
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64_reference(shape, dtype):
    q, k, v = qkv(shape, dtype)
    for visible in (None, holes(shape[0], shape[3], shape[4])):
        out = triton_attention.rowstable_attention_triton(q, k, v, visible, 0.3).cpu()
        ref = attention_reference(q.cpu(), k.cpu(), v.cpu(), None if visible is None else visible.cpu(), 0.3)
        err = (out.double() - ref).abs()
        bound = 2e-6 * max(1.0, float(ref.abs().max())) if dtype == torch.float32 else ref.abs() * 2.0**-8 + 1e-6
        assert bool((err <= bound).all()), float(err.max())


@runs_kernels
@pytest.mark.parametrize("shape", [*SHAPES[:3], SHAPES[4]])
def test_each_row_equals_that_row_alone(shape):
    q, k, v = qkv(shape, torch.bfloat16, seed=1)
    q_len, kv_len = shape[3], shape[4]
    together = triton_attention.rowstable_attention_triton(q, k, v)
    for i in range(q_len):
        end = kv_len - q_len + i + 1
        alone = triton_attention.rowstable_attention_triton(q[:, :, i : i + 1], k[:, :, :end], v[:, :, :end])
        assert torch.equal(alone[:, 0], together[:, i]), f"row {i}"
    # the same rows through an explicit causal mask (the masked kernel build) give the same bits
    causal = (torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len)).expand(shape[0], q_len, kv_len)
    assert torch.equal(triton_attention.rowstable_attention_triton(q, k, v, causal.to(DEVICE)), together)


@runs_kernels
def test_rows_of_one_chunk_and_of_several_in_one_call_each_equal_that_row_alone():
    """A row that fits in the first chunk is finished by the chunk kernel; its neighbours need the merge,
    and a chunk in the middle of a row can see nothing (masked out): each row still gets its own bits."""
    q, k, v = qkv((1, 2, 1, 3, 90, 16), torch.bfloat16, seed=2)
    visible = torch.ones(1, 3, 90, dtype=torch.bool)
    visible[0, 0, 20:] = False  # row 0: keys 0..19, one chunk
    visible[0, 1, 32:64] = False  # row 1: its second chunk sees nothing
    together = triton_attention.rowstable_attention_triton(q, k, v, visible.to(DEVICE))
    for i in range(3):
        alone = triton_attention.rowstable_attention_triton(q[:, :, i : i + 1], k, v, visible[:, i : i + 1].to(DEVICE))
        assert torch.equal(alone[:, 0], together[:, i]), f"row {i}"
    ref = attention_reference(q.cpu(), k.cpu(), v.cpu(), visible, None)
    err = (together.cpu().double() - ref).abs()
    assert bool((err <= ref.abs() * 2.0**-8 + 1e-6).all()), float(err.max())


@runs_kernels
def test_a_row_that_sees_nothing_gets_zeros_and_bad_shapes_raise():
    q, k, v = qkv((1, 2, 1, 2, 5, 16), torch.float32)
    visible = torch.ones(1, 2, 5, dtype=torch.bool, device=DEVICE)
    visible[0, 0] = False
    out = triton_attention.rowstable_attention_triton(q, k, v, visible).cpu()
    assert torch.equal(out[0, 0], torch.zeros(2, 16)) and bool(torch.isfinite(out).all())
    with pytest.raises(ValueError, match="rejected shapes"):
        triton_attention.rowstable_attention_triton(q, k[:, :, :1], v[:, :, :1])
    with pytest.raises(ValueError, match="visible must be a bool tensor"):
        triton_attention.rowstable_attention_triton(q, k, v, visible[:, :, :4])


def test_triton_attention_compiles_for_hopper_without_fma_contraction():
    """Ahead-of-time sm_90 builds of both kernels (no GPU needed); an interpreted session runs it in a child process."""
    if run_outside_the_interpreter(__file__, "test_triton_attention_compiles_for_hopper_without_fma_contraction"):
        return
    chunk_kernel, combine_kernel = triton_attention._jitted_kernels(False)
    floats = dict.fromkeys(["out_ptr", "pm_ptr", "pl_ptr", "pacc_ptr"], "*fp32")
    strides = ["q_sb", "q_sh", "q_sq", "k_sb", "k_sh", "k_sn", "v_sb", "v_sh", "v_sn", "m_sb", "m_sq"]
    chunk = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "mask_ptr": "*u8", "end_ptr": "*i32", **floats}
    chunk.update({**dict.fromkeys([*strides, "H", "Q", "D", "GROUP", "S"], "i32"), "scale": "fp32"})
    builds = [
        (chunk_kernel, chunk, {"HAS_MASK": True, "CHUNK": 128, "BLOCK_N": 64, "BLOCK_D": 128}),
        (combine_kernel, {"end_ptr": "*i32", **floats, **dict.fromkeys("HQDS", "i32")}, {"CHUNK": 128, "BLOCK_D": 128}),
    ]
    for kernel, signature, constants in builds:
        assert "fma.rn.f32" not in hopper_ptx(kernel, signature, constants), f"{kernel.fn.__name__}: contracted into FMAs"
