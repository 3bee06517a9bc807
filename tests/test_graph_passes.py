"""The post-grad pass of compiled steps (ops/graph_passes.py) and the C++ implementations of the ops
(ops/native.py).

- `quasar::w8a8_folded_norm_linears_cpu_packed` gives each consumer the bits an eager consumer computes
  (the reference oracle), and passes opcheck.
- The pass folds exactly the groups it may (a synthetic FX graph: an act_prescale, another backend or
  another reader of the norm's output leaves a linear alone), and rewrites nothing else.
- The C++ implementations compute their oracles' bits on ragged shapes, M = 1 included.
- A tiny W8A8 Llama compiled by Inductor with the pass: one folded op per group, verify rows equal
  decode steps, every op of the step served by C++ on CPU.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.fx

from quasar_hf.ops import cpu_fused, dispatch, native
from quasar_hf.ops.graph_passes import FoldNormsIntoW8A8Linears, compile_config, fold_group
from quasar_hf.ops.hadamard import HadamardRotation, rotate_rows_reference
from quasar_hf.ops.reference import (
    attention_reference,
    quantize_weight_per_channel,
    rowstable_linear_reference,
    rowstable_rms_norm_reference,
    w8a8_folded_group_reference,
    w8a8_linear_reference,
)

needs_cpu_fused = pytest.mark.skipif(not cpu_fused.is_available(), reason="the fused CPU W8A8 kernel is unavailable here")
needs_native = pytest.mark.skipif(
    not native.is_available(), reason=f"the ops' C++ library is unavailable: {native.unavailable_reason()}"
)
ops = torch.ops.quasar


def _weights(sizes=(24, 17, 9), k=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = []
    for i, n in enumerate(sizes):
        w_q, w_scale = quantize_weight_per_channel(torch.randn(n, k, generator=gen))
        weights.append((w_q, w_scale, torch.randn(n, generator=gen).bfloat16() if i == 1 else None))
    return weights


def _group_args(x, norm_weight, eps, offset, weights, emit_normed=False):
    """The folded op's arguments for `weights` [(int8 [N, K], scale, bias)], packed here."""
    packs = [cpu_fused.pack_weight(w) for w, _, _ in weights]
    return (
        x, norm_weight, eps, offset, [p.data for p in packs], [p.wsum128 for p in packs],
        [s for _, s, _ in weights], [b for _, _, b in weights], [w.shape[0] for w, _, _ in weights], emit_normed,
    )  # fmt: skip


@needs_cpu_fused
@pytest.mark.parametrize("rows", [1, 6])
def test_folded_op_gives_the_eager_groups_bits(rows):
    weights = _weights()
    x = torch.randn(1, rows, 40).bfloat16()
    norm_weight = torch.randn(40).bfloat16()
    for emit_normed in (False, True):  # with it, the norm's own output first (eager FoldedRMSNorm's call)
        args = _group_args(x, norm_weight, 1e-5, 1.0, weights, emit_normed)
        torch.library.opcheck(
            ops.w8a8_folded_norm_linears_cpu_packed.default, args, test_utils=("test_schema", "test_faketensor")
        )
        outputs = ops.w8a8_folded_norm_linears_cpu_packed(*args)
        expected = w8a8_folded_group_reference(x, weights, 1.0 + norm_weight.float(), 1e-5)[0 if emit_normed else 1 :]
        assert all(torch.equal(y, e) for y, e in zip(outputs, expected, strict=True))


@needs_cpu_fused
def test_folded_op_fake_names_a_weight_that_does_not_fit():
    args = list(_group_args(torch.randn(2, 40), torch.ones(40), 1e-5, 0.0, _weights(sizes=(8,))))
    args[-2] = [9]  # rows the packed weight does not hold
    with pytest.raises(Exception, match=r"weight_scale \[9\]"):  # opcheck wraps the ValueError of the fake
        torch.library.opcheck(ops.w8a8_folded_norm_linears_cpu_packed.default, args, test_utils=("test_faketensor",))


def _group_graph(prescale: bool = False, backend: str = "cpu_fused", other_reader: bool = False):
    """x -> quasar::rms_norm -> two W8A8 linear ops (q, k), as a compiled Llama layer traces."""
    graph = torch.fx.Graph()
    x, weight = graph.placeholder("x"), graph.placeholder("norm_weight")
    linear_args = []  # placeholders first, as Dynamo lays out graphs
    for name in ("q", "k"):
        w_q, w_scale, data, sums = (graph.placeholder(f"{name}_{part}") for part in ("weight", "scale", "data", "sums"))
        pre = graph.placeholder(f"{name}_prescale") if prescale else None
        if backend == "cpu_fused":  # what W8A8Linear calls on "cpu_fused"
            linear_args.append((ops.w8a8_linear_cpu_packed.default, (data, sums, w_scale, None, pre, 24 if name == "q" else 8)))
        else:
            linear_args.append((ops.w8a8_linear.default, (w_q, w_scale, None, pre, [data], backend)))
    norm = graph.call_function(ops.rms_norm.default, (x, weight, 1e-5, 0.0, False))
    outputs = [graph.call_function(op, (norm, *args)) for op, args in linear_args]
    if other_reader:
        outputs.append(graph.call_function(torch.ops.aten.neg.default, (norm,)))
    graph.output(tuple(outputs))
    return graph


def _targets(graph) -> collections.Counter:
    return collections.Counter(str(node.target) for node in graph.nodes if node.op == "call_function")


def test_the_pass_folds_a_norm_and_its_linears_into_one_op():
    graph = _group_graph()
    norm = next(n for n in graph.nodes if n.target is ops.rms_norm.default)
    assert fold_group(graph, norm) == 2
    graph.lint()
    assert _targets(graph) == {"quasar.w8a8_folded_norm_linears_cpu_packed.default": 1, "<built-in function getitem>": 2}


@pytest.mark.parametrize("case", ["prescale", "backend", "other_reader"])
def test_the_pass_leaves_what_it_cannot_fold(case):
    graph = _group_graph(
        prescale=case == "prescale", backend="torch" if case == "backend" else "cpu_fused", other_reader=case == "other_reader"
    )
    norm = next(n for n in graph.nodes if n.target is ops.rms_norm.default)
    folded = fold_group(graph, norm)
    targets = _targets(graph)
    if case == "other_reader":  # the linears fold; the other reader keeps reading the norm's own output
        assert folded == 2 and targets["quasar.rms_norm.default"] == 1 and targets["aten.neg.default"] == 1
    else:
        linear = "quasar.w8a8_linear.default" if case == "backend" else "quasar.w8a8_linear_cpu_packed.default"
        assert folded == 0 and targets[linear] == 2 and targets["quasar.rms_norm.default"] == 1


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
    norm = torch.randn(40).bfloat16()
    args = _group_args(x, norm, 1e-6, 0.0, weights, emit_normed=True)
    expected = w8a8_folded_group_reference(x, weights, norm.float(), 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(ops.w8a8_folded_norm_linears_cpu_packed(*args), expected, strict=True))
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


class _Recording(FoldNormsIntoW8A8Linears):
    """The pass, noting which quasar ops each graph holds after it ran."""

    def __init__(self) -> None:
        self.after: list[collections.Counter] = []

    def __call__(self, graph) -> None:
        super().__call__(graph)
        self.after.append(collections.Counter({t: c for t, c in _targets(graph).items() if t.startswith("quasar.")}))


@needs_cpu_fused
def test_inductor_with_the_pass_folds_every_group_and_stays_row_stable(tmp_path):
    from tests.test_compiled_rows import quasar_model, verify_and_decode_rows

    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    recording = _Recording()
    options = dict(compile_config(torch.device("cpu")).options, post_grad_custom_post_pass=recording)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, options=options)
    with torch.no_grad(), torch._inductor.utils.fresh_cache():  # an on-disk cache hit would skip the pass
        verify, decode = verify_and_decode_rows(model, compiled)
    assert torch.equal(verify, decode)
    assert len(recording.after) >= 2  # the pass ran on the verify and the decode graph
    for counts in recording.after:  # 2 layers: 2 folded groups each, o/down linears alone, the final norm
        assert counts["quasar.w8a8_folded_norm_linears_cpu_packed.default"] == 4
        assert counts["quasar.rms_norm.default"] == 1 and counts["quasar.rowstable_linear.default"] == 1
        if native.is_available():  # no op of the step calls back into Python: each has a C++ CPU kernel
            assert all(_has_cpu_kernel(target) for target in counts), counts


def test_default_compile_config_installs_the_pass():
    options = compile_config(torch.device("cpu")).options
    assert isinstance(options["post_grad_custom_post_pass"], FoldNormsIntoW8A8Linears)
    assert "post_grad_custom_post_pass" not in compile_config(torch.device("cuda")).options  # CPU ops only
    assert dispatch.resolve_backend("auto", "cpu") in dispatch.available_backends("cpu")


def test_without_a_cxx_compiler_the_native_ops_say_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("QUASAR_HF_KERNEL_CACHE", str(tmp_path / "kernels"))
    loaded = native._load.__wrapped__()  # uncached: a fresh attempt with this compiler
    assert loaded.error is not None and "building the C++ kernels failed" in loaded.error and "no-such-g++" in loaded.error


@needs_native
def test_native_ops_pass_opcheck():
    """Schema and fake of each op with a C++ CPU implementation against its real output."""
    x = torch.randn(2, 3, 40).bfloat16()
    pack = cpu_fused.pack_weight(torch.randint(-128, 128, (24, 40), dtype=torch.int8))
    rotation = HadamardRotation.for_size(40)
    query, key = torch.randn(1, 4, 3, 8).bfloat16(), torch.randn(1, 2, 5, 8).bfloat16()
    cases = {
        ops.w8a8_linear_cpu_packed.default: (x, pack.data, pack.wsum128, torch.rand(24), None, None, 24),
        ops.w8a8_folded_norm_linears_cpu_packed.default: _group_args(
            x, torch.randn(40).bfloat16(), 1e-6, 0.0, _weights(sizes=(24,))
        ),
        ops.rowstable_attention.default: (query, key, key.clone(), None, 0.3),
        ops.rowstable_linear.default: (x, torch.randn(9, 40).bfloat16(), None),
        ops.rms_norm.default: (x, torch.randn(40), 1e-6, 0.0, False),
        ops.hadamard_rows.default: (x, rotation.odd_signs(), rotation.blocks, rotation.pow2, rotation.scale),
    }
    for op, args in cases.items():
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"), op  # the C++ implementation serves it
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
