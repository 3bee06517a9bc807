"""RMSNorm folded into the W8A8 activation quantization of the linears it feeds (nn/folded_norm.py).

Oracles: reference.w8a8_linear_rmsnorm_reference (each consumer's output), bit for bit on "cpu_fused",
"reference" and "triton"; the norm's own output is the `quasar::rms_norm` op's.
The fold is a different rounding of the same function as norm-then-quantize, so model-level tests
against the unfolded model use a bound; every context (hooks, inference mode, grad, direct calls,
threads) must give the same bits; any reader other than the consumers sees normalized values.
"""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

import quasar_hf  # noqa: F401  (registers quant_method "quasar")
from quasar_hf import QuasarConfig, prepare_weights
from quasar_hf.hf.quantize_on_load import unfold_norms
from quasar_hf.nn import FoldedRMSNorm, RMSNormOutput
from quasar_hf.ops import cpu_fused, dispatch
from quasar_hf.ops.reference import (
    quantize_weight_per_channel,
    rms_factor_reference,
    rmsnorm_quantize_reference,
    rmsnorm_reference,
    w8a8_folded_group_reference,
    w8a8_linear_reference,
    w8a8_linear_rmsnorm_reference,
)
from tests.test_arch_gemma_phi import save_tiny_arch
from tests.tiny_models import assert_quasar_greedy_equals_plain, recording_aot_eager, save_tiny

needs_kernel = pytest.mark.skipif(not cpu_fused.is_available(), reason=f"fused CPU kernel: {cpu_fused.unavailable_reason()}")
FAST = dict(num_calibration_samples=4, calibration_seq_len=64, weight_rounding="nearest")
IDS = torch.tensor([[5, 17, 33, 2, 64, 90, 11, 7, 48, 21, 3, 77, 40, 8, 19, 60]])


def test_rms_factor_reference_is_rmsnorm_to_float_precision():
    x = torch.randn(5, 100, dtype=torch.float64) * 3
    exact = 1.0 / torch.sqrt(x.pow(2).mean(-1) + 1e-6)
    got = rms_factor_reference(x.float(), 1e-6).double()
    assert torch.allclose(got, exact, rtol=1e-6, atol=0)


def _group_weights(k, sizes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    weights = []
    for i, n in enumerate(sizes):
        q, s = quantize_weight_per_channel(torch.randn(n, k, generator=g))
        weights.append((q, s, torch.randn(n, generator=g).to(dtype) if i == 0 else None))
    return weights, torch.rand(k, generator=g) + 0.5, g


FOLDING_BACKENDS = [b for b in ("reference", "torch", "cpu_fused", "triton") if b in dispatch.available_backends("cpu")]


@pytest.mark.parametrize("backend", FOLDING_BACKENDS)
@pytest.mark.parametrize(
    ("k", "sizes", "m", "dtype"),
    [
        (64, (64, 32, 32), 1, torch.bfloat16),
        (100, (37, 5), 6, torch.float32),
        (33, (16,), 3, torch.float16),
        (576, (96, 48), 7, torch.bfloat16),
    ],
)
def test_folded_linear_equals_the_oracle(backend, k, sizes, m, dtype):
    """From the norm's input (any backend) and from the norm's quantized rows (where the backend takes
    them): cpu_fused, triton (interpreted here) and reference bit for bit. torch sums squares in its
    own order, so its r may differ by an ulp: within two units of the output dtype."""
    weights, scale, g = _group_weights(k, sizes, dtype, k)
    x = (torch.randn(m, k, generator=g) * 4).to(dtype)
    if m > 2:
        x[1] = 0  # a zero row: scale 0, outputs are the bias
        x[2, 0] = float("nan")  # a NaN row: NaN outputs
    prepared = [dispatch.prepare_w8a8(q, s, b, None, backend) for q, s, b in weights]
    normed = rmsnorm_reference(x, scale, 1e-5)
    from_x = RMSNormOutput.wrap(normed, x, scale, 1e-5)
    from_rows = RMSNormOutput.wrap(normed, x, scale, 1e-5, rmsnorm_quantize_reference(x, scale, 1e-5))
    expected = [w8a8_linear_rmsnorm_reference(x, scale, 1e-5, q, s, b) for q, s, b in weights]
    for act in (from_x, from_rows):
        outs = [p.folded(act) for p in prepared]
        if backend == "torch":  # one ulp of r, then the output's rounding: within two units of the dtype
            tol = dict(rtol=2e-2, atol=1e-3)
            assert all(
                torch.allclose(o.float().nan_to_num(7.0), e.float().nan_to_num(7.0), **tol) for o, e in zip(outs, expected)
            )
            continue
        for out, ref in zip(outs, expected):
            assert out.dtype == dtype and type(out) is torch.Tensor and torch.equal(out.nan_to_num(7.0), ref.nan_to_num(7.0))
        if m > 2:
            assert torch.isnan(outs[0][2]).all() and not torch.isnan(outs[0][[0, 1]]).any()


@needs_kernel
def test_one_folded_call_per_consumer_has_the_bits_of_the_grouped_call():
    """What an eager consumer calls (the norm's int8 rows through its GEMM, or the folded op with its own
    weight) and what the compiled grouping pass calls (every consumer of the norm at once) give each
    output the same bits; the norm's own quantization op gives the reference's rows and values."""
    weights, scale, g = _group_weights(96, (96, 32, 32), torch.bfloat16, 3)
    x = (torch.randn(2, 5, 96, generator=g) * 3).bfloat16()
    x[0, 1] = 0
    prepared = [dispatch.prepare_w8a8(q, s, b, None, "cpu_fused") for q, s, b in weights]
    grouped = torch.ops.quasar.w8a8_folded_norm_linears_cpu_packed(
        x, scale, 1e-6, -0.0, [p.packed.data for p in prepared], [p.packed.wsum128 for p in prepared],
        [s for _, s, _ in weights], [b for _, _, b in weights], [p.packed.out_features for p in prepared], True,
    )  # fmt: skip
    oracle = w8a8_folded_group_reference(x, weights, scale, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(grouped, oracle))
    normed, q, row_scale = torch.ops.quasar.rms_norm_quantize_rows(x, scale, 1e-6)
    expected_q, expected_scale = rmsnorm_quantize_reference(x, scale, 1e-6)
    assert torch.equal(normed, grouped[0]) and torch.equal(q, expected_q) and torch.equal(row_scale, expected_scale)
    for act in (RMSNormOutput.wrap(normed, x, scale, 1e-6, (q, row_scale)), RMSNormOutput.wrap(normed, x, scale, 1e-6)):
        assert all(torch.equal(p.folded(act), y) for p, y in zip(prepared, grouped[1:]))


def test_no_folded_form_where_the_fold_cannot_run():
    weights, scale, _ = _group_weights(32, (16,), torch.float32, 0)
    q, s, b = weights[0]
    assert dispatch.prepare_w8a8(q, s, b, torch.ones(32), "reference").folded is None  # an act_prescale of its own
    backends = ["reference", *(["cpu_fused"] if cpu_fused.is_available() else [])]
    for prepared in (dispatch.prepare_w8a8(q, s, b, None, name) for name in backends):
        narrow = torch.randn(2, 31)  # rows of another width
        assert prepared.folded(RMSNormOutput.wrap(narrow, narrow, torch.ones(31), 1e-5)) is None
        wide = torch.randn(2, 32, dtype=torch.float64)  # a dtype the kernels do not take
        assert prepared.folded(RMSNormOutput.wrap(wide, wide, scale, 1e-5)) is None


def test_bad_norm_eps_is_refused():
    norm = torch.nn.RMSNorm(32)
    for eps in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps"):
            FoldedRMSNorm(norm, 0.0, eps)


def _quantized(tmp_path, arch: str, dtype=torch.bfloat16, **options):
    src = save_tiny_arch(tmp_path / "src", "gemma3") if arch == "gemma3" else save_tiny(tmp_path / "src", arch)
    config = QuasarConfig(**FAST, **options)
    return AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=dtype).eval()


def _norms(model) -> list[FoldedRMSNorm]:
    return [m for m in model.modules() if isinstance(m, FoldedRMSNorm)]


def _folds(model) -> list[tuple[FoldedRMSNorm, list[torch.nn.Module]]]:
    """Each folded norm with the linears that read it (looked up in its decoder layer by the names it shows)."""
    found = []
    for layer in model.model.layers:
        for module in layer.modules():
            if isinstance(module, FoldedRMSNorm):
                found.append((module, [layer.get_submodule(name) for name in module.consumer_names]))
    return found


@pytest.mark.parametrize(
    ("arch", "backend"),
    [("llama", "reference"), ("qwen2", "auto"), ("gemma3", "auto")],
)
def test_folded_norm_outputs_equal_the_oracle(tmp_path, arch, backend):
    if backend == "auto" and not cpu_fused.is_available():
        pytest.skip("the fused CPU kernel is not built here")
    model = _quantized(tmp_path, arch, backend=backend)
    folds = _folds(model)
    assert len(folds) == len(_norms(model)) == 2 * model.config.num_hidden_layers  # attention and MLP input norms
    x = (torch.randn(1, 5, model.config.hidden_size) * 2).to(torch.bfloat16)
    for norm, consumers in folds:
        out = norm(x)
        scale = norm.offset + norm.weight.float()
        values = (
            rmsnorm_reference(x, scale, norm.eps) if norm._quantizes else torch.ops.quasar.rms_norm(x, norm.weight, *norm.formula)
        )
        assert type(out) is RMSNormOutput and torch.equal(out, values) and (out.quantized_rows() is not None) == norm._quantizes
        assert type(out * 1.0) is torch.Tensor  # any op on it gives a plain tensor: the fold stays here
        assert len(consumers) in (2, 3)
        for linear in consumers:
            expected = w8a8_linear_rmsnorm_reference(x, scale, norm.eps, linear.weight, linear.weight_scale, linear.bias)
            assert torch.equal(linear(out), expected)


def test_no_module_holds_another_module_of_the_model(tmp_path):
    """The fold lives in the activation: no back-references, no module reading a sibling's state."""
    model = _quantized(tmp_path, "llama", backend="reference")
    in_tree = {id(m) for m in model.modules()}

    def modules_in(value) -> list[torch.nn.Module]:
        if isinstance(value, torch.nn.Module):
            return [value]
        if isinstance(value, (tuple, list)):
            return [m for v in value for m in modules_in(v)]
        if isinstance(value, dict):
            return [m for v in value.values() for m in modules_in(v)]
        return []

    for module in model.modules():
        held = {k: v for k, v in vars(module).items() if k not in ("_modules", "_parameters", "_buffers")}
        assert not [m for m in modules_in(held) if id(m) in in_tree], type(module).__name__


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_folded_model_is_close_to_the_unfolded_one(tmp_path, arch):
    """Same function, one rounding fewer: logits differ by a fraction of the W8A8 error itself."""
    model = _quantized(tmp_path, arch, dtype=torch.float32)
    folded = model(IDS).logits
    assert unfold_norms(model) == 2 * model.config.num_hidden_layers and not _norms(model)
    unfolded = model(IDS).logits
    rel = ((folded - unfolded).norm() / unfolded.norm()).item()
    assert 0 < rel < 1e-2, f"fold moved the logits by {rel:.2e} (relative)"


class AdapterWrapper(torch.nn.Module):
    """The shape of a LoRA/PEFT adapter: the wrapped linear reads a new tensor computed from x."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x * 1.0)


@needs_kernel
def test_other_readers_of_the_norm_output_see_normalized_values(tmp_path):
    model = _quantized(tmp_path, "llama", dtype=torch.float32)
    reference = model(IDS).logits
    wrapped_model, hooked = copy.deepcopy(model), copy.deepcopy(model)
    unfold_norms(model)
    w8a8_error = 0.01  # a bound that means something: the fold's own distance from norm-then-quantize
    assert ((reference - model(IDS).logits).norm() / reference.norm()) < w8a8_error
    # A LoRA-style wrapper around q_proj and gate_proj after load: the wrapped linears read values.
    for layer in wrapped_model.model.layers:
        layer.self_attn.q_proj = AdapterWrapper(layer.self_attn.q_proj)
        layer.mlp.gate_proj = AdapterWrapper(layer.mlp.gate_proj)
    wrapped = wrapped_model(IDS).logits
    assert ((wrapped - reference).norm() / reference.norm()) < w8a8_error
    # An op inserted between the norm and its linears (here a forward hook replacing the output).
    for norm in _norms(hooked):
        norm.register_forward_hook(lambda module, args, out: out * 1.0)
    inserted = hooked(IDS).logits
    assert ((inserted - reference).norm() / reference.norm()) < w8a8_error
    assert not torch.equal(inserted, reference)  # the consumers quantized the values themselves


@needs_kernel
def test_every_context_computes_the_same_bits(tmp_path):
    model = _quantized(tmp_path, "llama")
    with torch.no_grad():
        expected = model(IDS).logits
    assert torch.equal(model(IDS).logits, expected)  # grad enabled
    with torch.inference_mode():
        assert torch.equal(model(IDS).logits, expected)
    handles = [model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: None)]
    handles.append(model.model.layers[1].input_layernorm.register_forward_pre_hook(lambda m, a: None))
    handles.append(model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: None))
    assert torch.equal(model(IDS).logits, expected)  # hooks added after load watch, change nothing
    for handle in handles:
        handle.remove()
    q_proj = model.model.layers[1].self_attn.q_proj
    for _ in range(5):  # direct calls of one consumer, their outputs used by nobody: no switch flips
        q_proj(torch.randn(1, 4, q_proj.in_features, dtype=torch.bfloat16))
    assert torch.equal(model(IDS).logits, expected)


@needs_kernel
def test_two_threads_on_one_model_get_what_sequential_calls_get(tmp_path):
    model = _quantized(tmp_path, "llama")
    prompts = [torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 14)]
    with torch.no_grad():
        logits = [model(p).logits for p in prompts]
    generated = [model.generate(p, max_new_tokens=12, do_sample=False, quasar=True) for p in prompts]
    failures = []

    def work(index: int) -> None:
        for _ in range(6):
            with torch.no_grad():
                if not torch.equal(model(prompts[index]).logits, logits[index]):
                    failures.append(("forward", index))
            out = model.generate(prompts[index], max_new_tokens=12, do_sample=False, quasar=True)
            if not torch.equal(out, generated[index]):
                failures.append(("generate", index))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@needs_kernel
def test_an_in_place_edit_needs_prepare_weights_and_it_is_enough(tmp_path):
    model = _quantized(tmp_path, "llama")
    norm, (q_proj, *_) = _folds(model)[0]
    x = (torch.randn(1, 3, model.config.hidden_size) * 2).to(torch.bfloat16)
    before = q_proj(norm(x))
    with torch.no_grad():
        q_proj.weight.neg_()
        norm.weight.mul_(2.0).add_(0.25)
    assert torch.equal(q_proj(norm(x)), before)  # the forward checks nothing: the prepared kernels run
    prepare_weights(model)
    scale = norm.weight.float()
    expected = w8a8_linear_rmsnorm_reference(x, scale, norm.eps, q_proj.weight, q_proj.weight_scale, q_proj.bias)
    assert torch.equal(q_proj(norm(x)), expected) and not torch.equal(expected, before)


@needs_kernel
def test_an_edit_between_the_norm_and_its_linear_is_seen(tmp_path):
    """Edited in place after the norm ran: the norm's input (the linear takes the rows quantized before,
    or quantizes the values), or its output (the linear quantizes the values it is given). Under
    inference mode the norm keeps a copy of its input."""
    model = _quantized(tmp_path, "llama")
    norm, (q_proj, *_) = _folds(model)[0]
    x = (torch.randn(1, 3, model.config.hidden_size) * 2).to(torch.bfloat16)
    folded = q_proj(norm(x))
    out = norm(x)
    x.mul_(3.0)  # the norm's input changes: the fold from x is dropped; the rows made from it stay right
    assert (out.fold() is None) and (out.quantized_rows() is not None) == norm._quantizes
    assert torch.equal(q_proj(out), folded if norm._quantizes else q_proj(out.as_subclass(torch.Tensor)))
    out = norm(x)
    out.mul_(-1.0)
    assert torch.equal(q_proj(out), w8a8_linear_reference(out.as_subclass(torch.Tensor), q_proj.weight, q_proj.weight_scale))
    with torch.inference_mode():
        y = x.clone()
        out = norm(y)
        y.mul_(5.0)  # an inference tensor has no version counter: the fold read a copy
        assert torch.equal(q_proj(out), q_proj(norm(x)))


@needs_kernel
def test_checkpoints_copies_and_moves_keep_the_fold(tmp_path):
    model = _quantized(tmp_path, "llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    logits = model(IDS).logits
    layer = model.model.layers[0]
    layer_twin = pickle.loads(pickle.dumps(layer))  # a pickled layer prepares its own scale and kernels
    x = torch.randn(1, 4, model.config.hidden_size, dtype=torch.bfloat16)
    assert type(layer_twin.post_attention_layernorm(x)) is RMSNormOutput
    assert torch.equal(layer_twin.mlp(layer_twin.post_attention_layernorm(x)), layer.mlp(layer.post_attention_layernorm(x)))
    for twin in (copy.deepcopy(model), model.to("cpu")):
        assert len(_norms(twin)) == 2 * model.config.num_hidden_layers
        assert torch.equal(twin(IDS).logits, logits)
    model.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert state.keys() == reloaded.state_dict().keys()  # the norm keeps its weight's key
    assert all(torch.equal(state[k], v) for k, v in reloaded.state_dict().items())
    assert torch.equal(reloaded(IDS).logits, logits)
    reloaded.load_state_dict(state)  # load_state_dict prepares again
    assert torch.equal(reloaded(IDS).logits, logits)


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_greedy_quasar_equals_plain_with_folded_norms(tmp_path, arch):
    model = _quantized(tmp_path, arch)
    assert _norms(model)
    assert_quasar_greedy_equals_plain(model, max_new_tokens=24)


def test_reference_backend_folds_and_decodes_exactly(tmp_path):
    model = _quantized(tmp_path, "llama", backend="reference")
    assert _norms(model)
    assert_quasar_greedy_equals_plain(model, max_new_tokens=12)


@needs_kernel
def test_a_model_with_folded_norms_compiles_into_one_graph(tmp_path):
    """Under torch.compile the folded norm is `quasar::rms_norm` and the consumers run as W8A8 ops:
    fullgraph, no break. Compiled need not equal eager: within W8A8 error."""
    model = _quantized(tmp_path, "llama")
    seen = []
    backend = recording_aot_eager(seen)

    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(IDS).logits.float()
        compiled = torch.compile(model.forward, fullgraph=True, backend=backend)(input_ids=IDS).logits.float()
    assert sum("quasar.w8a8_linear" in t for t in seen) == 7 * model.config.num_hidden_layers
    assert ((compiled - eager).norm() / eager.norm()) < 0.05
