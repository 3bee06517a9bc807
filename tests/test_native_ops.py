"""The C++ implementations of the ops (ops/native.py), and what a compiled step's graph calls.

- `quasar::w8a8_folded_norm_linear_cpu_packed` gives the reference oracle's bits, and
  passes opcheck.
- The C++ implementations compute their oracles' bits on ragged shapes, M = 1 included.
- A tiny W8A8 Llama compiled by Inductor with the default CompileConfig (no graph pass): the modules'
  own fused ops, one per norm-folded group, verify rows equal decode steps, every op of the step
  served by C++ on CPU.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from quasar_hf.compat import default_compile_config as compile_config
from quasar_hf.ops import cpu_fused, dispatch, native
from quasar_hf.ops.hadamard import HadamardRotation, rotate_rows_reference
from quasar_hf.ops.reference import (
    attention_reference,
    quantize_weight_per_channel,
    rowstable_linear_reference,
    rowstable_rms_norm_reference,
    w8a8_linear_reference,
    w8a8_linear_rmsnorm_reference,
)
from tests.helpers.kernels import require_kernels

needs_cpu_fused = pytest.mark.kernels("w8a8")
needs_native = pytest.mark.kernels()
ops = torch.ops.quasar


def _weights(sizes=(24, 17, 9), k=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = []
    for i, n in enumerate(sizes):
        w_q, w_scale = quantize_weight_per_channel(torch.randn(n, k, generator=gen))
        weights.append((w_q, w_scale, torch.randn(n, generator=gen).bfloat16() if i == 1 else None))
    return weights


def _folded_args(x, norm_scale, eps, weight):
    """The folded op's arguments for `weight` (int8 [N, K], scale, bias), packed here."""
    w_q, w_scale, bias = weight
    pack = cpu_fused.pack_weight(w_q)
    return x, norm_scale, eps, pack.data, pack.wsum128, w_scale, bias, w_q.shape[0]


@needs_cpu_fused
@pytest.mark.parametrize("rows", [1, 6])
def test_folded_op_gives_the_oracle_bits(rows):
    x = torch.randn(1, rows, 40).bfloat16()
    x[0, 0] = 0  # a zero row: the bias
    norm_scale = 1.0 + torch.randn(40).bfloat16().float()
    for weight in _weights():
        args = _folded_args(x, norm_scale, 1e-5, weight)
        torch.library.opcheck(ops.w8a8_folded_norm_linear_cpu_packed.default, args, test_utils=("test_schema", "test_faketensor"))
        assert torch.equal(
            ops.w8a8_folded_norm_linear_cpu_packed(*args), w8a8_linear_rmsnorm_reference(x, norm_scale, 1e-5, *weight)
        )


@needs_cpu_fused
def test_folded_op_fake_names_what_does_not_fit():
    args = list(_folded_args(torch.randn(2, 40), torch.ones(40), 1e-5, _weights(sizes=(8,))[0]))
    args[-1] = 9  # rows the packed weight does not hold
    with pytest.raises(Exception, match=r"weight_scale \[9\]"):  # opcheck wraps the ValueError of the fake
        torch.library.opcheck(ops.w8a8_folded_norm_linear_cpu_packed.default, args, test_utils=("test_faketensor",))
    args = list(_folded_args(torch.randn(2, 40), torch.ones(40).bfloat16(), 1e-5, _weights(sizes=(8,))[0]))
    with pytest.raises(Exception, match=r"norm_scale must be fp32 \[40\]"):
        torch.library.opcheck(ops.w8a8_folded_norm_linear_cpu_packed.default, args, test_utils=("test_faketensor",))


def _targets(graph) -> collections.Counter:
    return collections.Counter(str(node.target) for node in graph.nodes if node.op == "call_function")


@needs_native
@pytest.mark.parametrize("rows", [1, 7])
def test_cpp_w8a8_and_attention_compute_the_oracles_bits(rows):
    """The ops' C++ CPU implementations against their plain-PyTorch oracles (attention: the fp64 one)."""
    weights = _weights(sizes=(24, 17))
    x = torch.randn(2, rows, 40).bfloat16()  # [B, S, K]
    prescale = torch.rand(40) + 0.5
    for w_q, w_scale, bias in weights:
        pack = cpu_fused.pack_weight(w_q)
        expected = w8a8_linear_reference(x, w_q, w_scale, bias, prescale)
        actual = ops.w8a8_linear_cpu_packed(x, pack.data, pack.wsum128, w_scale, bias, prescale, w_q.shape[0])
        assert torch.equal(actual, expected)
    norm_scale = 1.0 + torch.randn(40).bfloat16().float()
    for weight in weights:
        expected = w8a8_linear_rmsnorm_reference(x, norm_scale, 1e-6, *weight)
        assert torch.equal(ops.w8a8_folded_norm_linear_cpu_packed(*_folded_args(x, norm_scale, 1e-6, weight)), expected)
    query = torch.randn(2, 6, rows, 16).bfloat16()
    key, value = torch.randn(2, 3, rows + 5, 16).bfloat16(), torch.randn(2, 3, rows + 5, 16).bfloat16()
    visible = torch.rand(2, rows, rows + 5) > 0.4
    visible[..., 0] = True
    for mask, scale in ((visible, 0.3), (None, None)):
        expected = attention_reference(query, key, value, mask, scale)
        actual = ops.rowstable_attention(query, key, value, mask, scale).double()
        assert bool(((actual - expected).abs() <= 2.0**-7 * (1 + expected.abs())).all())


@needs_native
@pytest.mark.parametrize("rows", [1, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpp_lm_head_norm_and_rotation_compute_the_oracles_bits(rows, dtype):
    """The ops' C++ CPU implementations against their plain-PyTorch oracles, bit for bit."""
    x = torch.randn(2, rows, 40).to(dtype)  # [B, S, K], K = 40: ragged for every kernel's vector width
    head, bias = torch.randn(37, 40).to(dtype), torch.randn(37).to(dtype)
    for b in (None, bias):
        assert torch.equal(ops.rowstable_linear(x, head, b), rowstable_linear_reference(x, head, b))
    for scale_in_float, offset, weight_dtype in ((False, 0.0, dtype), (True, 1.0, dtype), (False, 0.0, torch.float32)):
        weight = torch.randn(40).to(weight_dtype)
        expected = rowstable_rms_norm_reference(x, weight, 1e-6, offset, scale_in_float)
        actual = ops.rms_norm(x, weight, 1e-6, offset, scale_in_float)
        assert actual.dtype == expected.dtype and torch.equal(actual, expected)
    assert torch.equal(
        ops.rms_norm(x.transpose(0, 1), weight, 1e-6, 0.0, False),
        rowstable_rms_norm_reference(x.transpose(0, 1), weight, 1e-6, 0.0, False),
    )
    for width in (40, 12 * 16, 3 * 64, 6):  # H_20 (x) H_2, H_12 (x) H_16, Sylvester alone, blocks of H_2
        r = HadamardRotation.for_size(width)
        rows_x = torch.randn(rows, 3, width).to(dtype).transpose(0, 1)  # not contiguous
        expected = rotate_rows_reference(rows_x, r)
        assert torch.equal(ops.hadamard_rows(rows_x, r.odd_signs(), r.blocks, r.pow2, r.scale), expected)


def _has_cpu_kernel(target: str) -> bool:
    """True if the op `quasar.<name>.default` has a kernel registered for the CPU dispatch key (C++)."""
    name = "quasar::" + target.split(".")[1]
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")


class _Recording(CustomGraphPass):
    """An observer in Inductor's post-grad slot: notes which quasar ops each graph holds, changes nothing."""

    def __init__(self) -> None:
        self.after: list[collections.Counter] = []

    def __call__(self, graph) -> None:
        self.after.append(collections.Counter({t: c for t, c in _targets(graph).items() if t.startswith("quasar.")}))

    def uuid(self) -> bytes:
        return b"recording"


@needs_cpu_fused
def test_inductor_graph_calls_one_fused_op_per_group_and_stays_row_stable(tmp_path):
    from tests.helpers.compiled_steps import verify_and_decode_rows
    from tests.helpers.tiny_models import quasar_model

    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    recording = _Recording()
    options = dict(compile_config(torch.device("cpu")).options, post_grad_custom_post_pass=recording)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, options=options)
    with torch.no_grad(), torch._inductor.utils.fresh_cache():  # an on-disk cache hit would skip the observer
        verify, decode = verify_and_decode_rows(model, compiled)
    assert torch.equal(verify, decode)
    assert len(recording.after) >= 2  # the verify and the decode graph
    for counts in recording.after:  # 2 layers: 2 norm-folded groups each, o/down linears alone, the final norm
        assert counts["quasar.w8a8_folded_norm_linear_cpu_packed.default"] == 4
        assert counts["quasar.rms_norm.default"] == 1 and counts["quasar.rowstable_linear.default"] == 1
        if native.is_available():  # no op of the step calls back into Python: each has a C++ CPU kernel
            assert all(_has_cpu_kernel(target) for target in counts), counts


def test_default_compile_config_installs_no_graph_pass():
    for device in ("cpu", "cuda"):
        assert "post_grad_custom_post_pass" not in compile_config(torch.device(device)).options
    assert dispatch.resolve_backend("auto", "cpu") in dispatch.available_backends("cpu")


def test_without_a_cxx_compiler_the_native_ops_say_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("QUASAR_HF_KERNEL_CACHE", str(tmp_path / "kernels"))
    loaded = native._load.__wrapped__()  # uncached: a fresh attempt with this compiler
    assert loaded.error is not None and "building the C++ kernels failed" in loaded.error and "no-such-g++" in loaded.error


@needs_native
def test_cpp_defines_no_schema_and_a_withdrawn_implementation_stops_serving():
    """C++ registers implementations of the table's schemas only; one whose smoke test fails is withdrawn
    (ops/native.py), and the op's plain-PyTorch fallback serves again."""
    from quasar_hf.ops.torch_ops import OPS

    own = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("quasar::native_")}
    assert own == {
        f"quasar::native_{n}" for n in ("kernel_builds", "implemented_ops", "register_cpu_kernel", "unregister_cpu_kernel")
    }
    assert set(ops.native_implemented_ops()) <= {op.name for op in OPS if op.kernel}
    spec = next(op for op in OPS if op.name == "rowstable_linear")
    args = spec.sample(torch.Generator().manual_seed(0))
    ops.native_unregister_cpu_kernel("rowstable_linear")
    try:
        assert not torch._C._dispatch_has_kernel_for_dispatch_key("quasar::rowstable_linear", "CPU")
        assert torch.equal(ops.rowstable_linear(*args), spec.fallback(*args))
    finally:
        ops.native_register_cpu_kernel("rowstable_linear")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("quasar::rowstable_linear", "CPU")
    with pytest.raises(RuntimeError, match="already registered"):
        ops.native_register_cpu_kernel("rowstable_linear")
    with pytest.raises(RuntimeError, match="no C\\+\\+ implementation"):
        ops.native_register_cpu_kernel("w8a8_linear")


@needs_native
def test_native_ops_pass_opcheck():
    """Schema and fake of each op with a C++ CPU implementation against its real output."""
    x = torch.randn(2, 3, 40).bfloat16()
    pack = cpu_fused.pack_weight(torch.randint(-128, 128, (24, 40), dtype=torch.int8))
    rotation = HadamardRotation.for_size(40)
    query, key = torch.randn(1, 4, 3, 8).bfloat16(), torch.randn(1, 2, 5, 8).bfloat16()
    cases = {
        ops.w8a8_linear_cpu_packed.default: (x, pack.data, pack.wsum128, torch.rand(24), None, None, 24),
        ops.w8a8_folded_norm_linear_cpu_packed.default: _folded_args(x, torch.rand(40) + 0.5, 1e-6, _weights(sizes=(24,))[0]),
        ops.w8a8_accumulators_cpu_packed.default: (x, pack.data, pack.wsum128, None, 24),
        ops.rowstable_attention.default: (query, key, key.clone(), None, 0.3),
        ops.rowstable_linear.default: (x, torch.randn(9, 40).bfloat16(), None),
        ops.rms_norm.default: (x, torch.randn(40), 1e-6, 0.0, False),
        ops.hadamard_rows.default: (x, rotation.odd_signs(), rotation.blocks, rotation.pow2, rotation.scale),
    }
    if "prefill_attention" in native.kernel_builds():  # its builds need AVX2 + FMA
        prompt = torch.randn(1, 4, 5, 32).bfloat16(), torch.randn(1, 2, 5, 32).bfloat16(), torch.randn(1, 2, 5, 32).bfloat16()
        cases[ops.prefill_attention.default] = (*prompt, None)
    for op, args in cases.items():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"), op  # the C++ implementation serves it
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_kernels_load_after_the_standard_librarys_distutils_was_imported_first(tmp_path):
    """pip imported, setuptools' distutils shim steps aside, and `import distutils.core` loads the standard
    library's; importing setuptools then fails. Loading the kernels (a build cached or made here) needs neither."""
    pytest.importorskip("distutils", reason="this Python has no standard-library distutils (3.12 and later)")
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import pip, distutils.core, sys\n"
        "from quasar_hf.ops import native\n"
        "from quasar_hf.ops.kernel_ops import KERNEL_OPS\n"
        "assert native.is_available(), native.unavailable_reason()\n"
        "builds = native.kernel_builds()  # a kernel with no build for this CPU (no AVX2: the prompt kernel's) is not a failure\n"
        "failed = [(op.name, native.op_unavailable_reason(op.name)) for op in KERNEL_OPS if op.kernel in builds and native.op_unavailable_reason(op.name)]\n"
        "assert not failed, failed\n"
        "assert 'setuptools' not in sys.modules\n"
        "print('LOADED')\n"
    )
    require_kernels()
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert "LOADED" in out.stdout, out.stderr[-2000:]
