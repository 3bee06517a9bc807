"""GPU regression checks (run by `benchmarks/gpu/gpu_check.sh` through `pytest -m cuda`; skipped without a
CUDA device): the W8A8 backends against the reference, the row-stable attention kernel's rows,
greedy `quasar=True` equal to plain greedy eagerly and compiled, and compiled verify rows equal
to compiled decode calls. Tiny models: seconds each, but for the compiles.
"""

from __future__ import annotations

import pytest
import torch

from quasar_hf.ops.dispatch import available_backends, w8a8_linear
from quasar_hf.ops.kernel_ops import KERNEL_OPS
from quasar_hf.ops.reference import attention_reference, quantize_weight_per_channel, w8a8_linear_reference
from quasar_hf.ops.rowstable_attention import rowstable_kernel_for
from tests.helpers.compiled_steps import verify_and_decode_rows
from tests.helpers.prompts import repeating_prompt
from tests.helpers.tiny_models import quasar_model

pytestmark = pytest.mark.cuda
DEVICE = "cuda"
W8A8_TOLERANCE = 2e-2  # largest |error| / largest |reference| a backend may show (gpu_check's bound): not all are exact
ATTENTION_TOLERANCE = next(op.tolerance for op in KERNEL_OPS if op.name == "rowstable_attention")  # vs the fp64 oracle


@pytest.mark.parametrize("rows", [1, 6, 64])  # decode, a 5-draft verify, a prefill
def test_every_w8a8_backend_matches_the_reference(rows):
    g = torch.Generator().manual_seed(rows)
    weight_q, weight_scale = (t.to(DEVICE) for t in quantize_weight_per_channel(torch.randn(256, 128, generator=g) * 0.02))
    x = torch.randn(rows, 128, generator=g).bfloat16().to(DEVICE)
    bias = torch.randn(256, generator=g).bfloat16().to(DEVICE)
    expected = w8a8_linear_reference(x, weight_q, weight_scale, bias).float()
    backends = [b for b in available_backends(DEVICE) if b != "reference"]
    assert backends, "no W8A8 backend runs on this device"
    for backend in backends:
        out = w8a8_linear(x, weight_q, weight_scale, bias=bias, backend=backend).float()
        assert float((out - expected).abs().max() / expected.abs().max()) < W8A8_TOLERANCE, backend


def test_the_row_stable_attention_kernel_gives_a_verify_row_the_bits_of_its_decode_step():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 6, 16, generator=g).bfloat16().to(DEVICE)
    k, v = (torch.randn(1, 2, 64, 16, generator=g).bfloat16().to(DEVICE) for _ in range(2))
    kernel = rowstable_kernel_for(q, k, v)
    assert kernel is not None, "no row-stable attention kernel on this device (verification would run SDPA row by row)"
    out = kernel(q, k, v, None, None)  # row i sees keys 0 .. 58 + i
    expected = attention_reference(q.cpu(), k.cpu(), v.cpu())
    assert bool(((out.double().cpu() - expected).abs() <= ATTENTION_TOLERANCE * (1 + expected.abs())).all())
    for row in range(6):
        alone = kernel(q[:, :, row : row + 1], k[:, :, : 59 + row], v[:, :, : 59 + row], None, None)
        assert torch.equal(alone[:, 0], out[:, row]), row


@pytest.fixture(scope="module")
def tiny_quasar(tmp_path_factory) -> torch.nn.Module:
    """A tiny bf16 W8A8 Llama, calibrated and quantized on the device (`from_pretrained(device_map=...)`)."""
    return quasar_model(tmp_path_factory.mktemp("cuda"), "llama", torch.bfloat16, device_map=DEVICE)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_greedy_quasar_equals_plain_greedy(tiny_quasar, compiled):
    """What `same-bits` checks in each tree: speculative greedy decoding gives plain greedy's tokens."""
    options = {"compile": True} if compiled else True
    for seed in range(2):
        prompt = repeating_prompt(seed).to(DEVICE)
        plain_options = {"compile": True, "num_draft_tokens": 0} if compiled else False
        plain = tiny_quasar.generate(prompt, max_new_tokens=16, do_sample=False, quasar=plain_options)
        out = tiny_quasar.generate(prompt, max_new_tokens=16, do_sample=False, quasar=options, return_dict_in_generate=True)
        assert out.quasar_stats.verify_steps > 0
        assert torch.equal(out.sequences, plain), seed
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "mode", [{"backend": "aot_eager"}, {"options": {"emulate_precision_casts": True}}], ids=["aot_eager", "inductor"]
)
def test_a_compiled_verify_call_gives_the_rows_of_compiled_decode_calls(tiny_quasar, mode):
    """What `compiled-rows` checks: over a static cache, a compiled verify call of 4 tokens equals 4 one-token calls."""
    torch._dynamo.reset()
    compiled = torch.compile(tiny_quasar.forward, fullgraph=True, dynamic=False, **mode)
    with torch.no_grad():
        verify, decode = verify_and_decode_rows(tiny_quasar, compiled)
    torch._dynamo.reset()
    assert torch.equal(verify, decode)
