"""Compiled steps are row-stable: over a static KV cache, one compiled verify call of k+1 tokens (here k = 3) gives
the logits of k+1 compiled one-token decode calls, bit for bit, and warm steps do not recompile.

This is what makes greedy `quasar=True` exact in compiled mode (compiled need not equal eager, but a
verified row must equal the decode step it stands for). Every reduction in a step is an op of ours
(W8A8 linears, row-stable attention, the lm_head) or a per-row torch reduction (the norms). The
sweep over architectures runs Dynamo + AOTAutograd with eager kernels (seconds per model); one
architecture also runs Inductor's generated code. A negative control routes the lm_head through
`F.linear` under compile and shows the rows then differ.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from quasar_hf.nn import RowStableLinear
from quasar_hf.ops import rowstable_linear
from tests.helpers.compiled_steps import DRAFTS, PROMPT, prefilled, step, verify_and_decode_rows
from tests.helpers.tiny_models import quasar_model

needs_kernels = pytest.mark.kernels("rowstable_linear")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> torch.nn.Module:
    return quasar_model(tmp_path_factory.mktemp("compiled_rows"), "llama")


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
def test_compiled_verify_rows_equal_compiled_decode_steps(tmp_path, arch):
    model = quasar_model(tmp_path, arch)
    assert isinstance(model.get_output_embeddings(), RowStableLinear)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad():
        verify, decode = verify_and_decode_rows(model, compiled)
    assert torch.equal(verify, decode), f"max |diff| {(verify - decode).abs().max().item():.3g}"


@needs_kernels
def test_inductor_steps_are_row_stable_and_do_not_recompile_once_warm(tmp_path):
    model = quasar_model(tmp_path, "qwen3", torch.bfloat16)  # q/k norms, bf16 rounding between ops
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True})
    with torch.no_grad():
        verify, decode = verify_and_decode_rows(model, compiled)
        assert torch.equal(verify, decode)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert graphs == 2, "one graph per step length (1 and 4 tokens)"
        cache = prefilled(model)
        with torch._dynamo.config.patch(error_on_recompile=True):  # warm: new positions, new cache contents
            for position in range(PROMPT.shape[1], PROMPT.shape[1] + 4):
                step(compiled, cache, DRAFTS[:, :1], position)
            step(compiled, cache, DRAFTS, PROMPT.shape[1] + 4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@needs_kernels
def test_negative_control_a_float_lm_head_breaks_compiled_row_stability(tiny_llama, monkeypatch):
    model = tiny_llama
    monkeypatch.setattr(rowstable_linear, "available_when_compiled", lambda: False)  # lm_head traces as F.linear
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad():
        verify, decode = verify_and_decode_rows(model, compiled)
    torch._dynamo.reset()
    assert not torch.equal(verify, decode), "F.linear's rounding depends on the row count; the test must see that"


@needs_kernels
def test_the_lm_head_op_computes_the_eager_kernel_bits():
    linear = RowStableLinear.from_linear(torch.nn.Linear(64, 96))
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        assert torch.equal(torch.ops.quasar.rowstable_linear(x, linear.weight, linear.bias), linear(x))
        compiled = torch.compile(linear, fullgraph=True, backend="aot_eager")
        assert torch.equal(compiled(x), linear(x))
    torch._dynamo.reset()


@needs_kernels
def test_compiled_rows_measurement_reports_a_checkpoint(tmp_path, tiny_llama):
    """`python -m benchmarks compiled-rows` on a saved tiny checkpoint (the fast mode only)."""
    import json

    from benchmarks.speed import compiled_rows

    tiny_llama.save_pretrained(tmp_path / "saved")
    out = tmp_path / "rows.json"
    argv = ["--quantized", str(tmp_path / "saved"), "--modes", "aot_eager", "--prompt-tokens", "8", "--out", str(out)]
    report = compiled_rows.main(argv)
    torch._dynamo.reset()
    (row,) = report["results"]
    assert row["mode"] == "aot_eager" and row["rows_equal"] and row["rows_differing"] == 0 and row["unique_graphs"] == 2
    assert json.loads(out.read_text())["environment"] and "| aot_eager | yes |" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit, match="unknown modes"):
        compiled_rows.main(["--quantized", "x", "--modes", "fast"])


def test_the_lm_head_compiles_with_gradients_as_a_plain_linear():
    """The op has no autograd formula: compiled with gradients the module is F.linear, and trains."""
    linear = RowStableLinear.from_linear(torch.nn.Linear(64, 96))
    x = torch.randn(3, 64)
    compiled = torch.compile(linear, fullgraph=True, backend="aot_eager")
    compiled(x).sum().backward()
    torch._dynamo.reset()
    assert torch.allclose(linear.weight.grad, torch.ones(96, 1) * x.sum(0)[None], rtol=1e-5, atol=1e-5)
