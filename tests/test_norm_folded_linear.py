"""An RMSNorm and the projections it feeds as one W8A8 linear (nn/norm_folded_linear.py, hf/fusion.py).

Oracles: reference.w8a8_linear_rmsnorm_reference for each projection's columns, bit for bit on
"cpu_fused", "reference" and "triton" (interpreted here); torch sums squares in its own order (two
units of the output dtype). Stacking is exact by construction: int32 sums and a per-column epilogue,
so each projection's columns of the stacked output have the bits of that projection alone, and of
the path eager modules took before fusion (the norm's int8 rows through each projection's GEMM).
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
from quasar_hf.hf.fusion import checkpoint_linears, fuse_projections, projections_apart, unfuse_projections
from quasar_hf.nn import FusedProjectionSlice, NormFoldedW8A8Linear, W8A8Linear
from quasar_hf.ops import dispatch
from quasar_hf.ops.reference import (
    quantize_weight_per_channel,
    rms_factor_reference,
    rmsnorm_quantize_reference,
    w8a8_linear_quantized_reference,
    w8a8_linear_rmsnorm_reference,
)
from tests.helpers.kernels import require_kernels
from tests.helpers.tiny_archs import save_tiny_arch
from tests.helpers.tiny_models import assert_quasar_greedy_equals_plain, recording_aot_eager, save_tiny

needs_kernel = pytest.mark.kernels("w8a8")
FAST = dict(num_calibration_samples=4, calibration_seq_len=64, weight_rounding="nearest")
IDS = torch.tensor([[5, 17, 33, 2, 64, 90, 11, 7, 48, 21, 3, 77, 40, 8, 19, 60]])
FOLDING_BACKENDS = [b for b in ("reference", "torch", "cpu_fused", "triton") if b in dispatch.available_backends("cpu")]


def test_rms_factor_reference_is_rmsnorm_to_float_precision():
    x = torch.randn(5, 100, dtype=torch.float64) * 3
    exact = 1.0 / torch.sqrt(x.pow(2).mean(-1) + 1e-6)
    assert torch.allclose(rms_factor_reference(x.float(), 1e-6).double(), exact, rtol=1e-6, atol=0)


def _members(k, sizes, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    members = []
    for n in sizes:
        q, s = quantize_weight_per_channel(torch.randn(n, k, generator=g))
        members.append((q, s, torch.randn(n, generator=g).to(dtype) if bias else None))
    return members, torch.rand(k, generator=g) + 0.5, g


def _stacked(members, backend):
    q = torch.cat([m[0] for m in members])
    s = torch.cat([m[1] for m in members])
    b = None if members[0][2] is None else torch.cat([m[2] for m in members])
    linear = W8A8Linear(q.shape[1], q.shape[0], bias=b is not None, backend=backend, bias_dtype=None if b is None else b.dtype)
    linear.weight.copy_(q)
    linear.weight_scale.copy_(s)
    if b is not None:
        linear.bias.copy_(b)
    linear.prepare()
    return linear


@pytest.mark.parametrize("backend", FOLDING_BACKENDS)
@pytest.mark.parametrize(
    ("k", "sizes", "m", "dtype", "bias"),
    [
        (64, (64, 32, 32), 1, torch.bfloat16, True),
        (100, (37, 5), 6, torch.float32, False),
        (33, (16,), 3, torch.float16, True),
        (576, (96, 48, 48), 7, torch.bfloat16, False),
    ],
)
def test_stacked_folded_linear_gives_each_member_the_oracle_bits(backend, k, sizes, m, dtype, bias):
    """M = 1 and ragged K and N; a zero row (scale 0: the bias) and a NaN row (NaN outputs)."""
    members, scale, g = _members(k, sizes, dtype, k, bias)
    x = (torch.randn(m, k, generator=g) * 4).to(dtype)
    if m > 2:
        x[1] = 0
        x[2, 0] = float("nan")
    linear = _stacked(members, backend)
    assert linear.folds_rms_norm
    out = linear.of_rms_norm(x, scale, 1e-5)
    assert out.shape == (m, sum(sizes)) and out.dtype == dtype
    start = 0
    for q, s, b in members:
        got, start = out[:, start : start + q.shape[0]], start + q.shape[0]
        expected = w8a8_linear_rmsnorm_reference(x, scale, 1e-5, q, s, b)
        if backend == "torch":  # one ulp of r, then the output's rounding
            assert torch.allclose(got.float().nan_to_num(7.0), expected.float().nan_to_num(7.0), rtol=2e-2, atol=1e-3)
        else:
            assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
    if m > 2:
        assert torch.isnan(out[2]).all() and not torch.isnan(out[[0, 1]]).any()


@needs_kernel
def test_stacked_call_has_the_bits_of_each_projection_alone():
    """Before fusion each projection quantized the norm's rows once more and ran its own GEMM on them
    (reference: the rows of rmsnorm_quantize_reference through w8a8_linear_quantized_reference); the
    stacked op gives each projection's columns those very bits, and those of its own folded call."""
    members, scale, g = _members(96, (96, 32, 32), torch.bfloat16, 3)
    x = (torch.randn(2, 5, 96, generator=g) * 3).bfloat16()
    x[0, 1] = 0
    out = _stacked(members, "cpu_fused").of_rms_norm(x, scale, 1e-6)
    q, row_scale = rmsnorm_quantize_reference(x, scale, 1e-6)
    start = 0
    for member in members:
        alone = _stacked([member], "cpu_fused").of_rms_norm(x, scale, 1e-6)
        per = w8a8_linear_quantized_reference(x, q, row_scale, *member)
        columns = out[..., start : start + member[0].shape[0]]
        assert torch.equal(columns, per) and torch.equal(columns, alone)
        start += member[0].shape[0]


def test_no_fold_where_it_cannot_run():
    members, scale, _ = _members(32, (16,), torch.float32, 0)
    q, s, b = members[0]
    linear = W8A8Linear.from_weight(q.float() * s[:, None], b, torch.ones(32), backend="reference")
    assert not linear.folds_rms_norm  # an act_prescale of its own: the fold's scale would replace it
    assert linear.of_rms_norm(torch.randn(2, 32), scale, 1e-5) is None


def test_bad_norm_eps_and_bad_input_width_are_refused():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    members, _, _ = _members(32, (16, 8), torch.float32, 0)
    for eps in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps"):
            NormFoldedW8A8Linear(LlamaRMSNorm(32, eps=eps), _stacked(members, "reference"), [("a", 0, 16), ("b", 16, 24)])
    with pytest.raises(ValueError, match="fused into 'input_layernorm'.*width 24, got width 32"):
        FusedProjectionSlice(0, 16, 24, "input_layernorm")(torch.randn(1, 32))


def _quantized(tmp_path, arch: str, dtype=torch.bfloat16, **options):
    if arch in ("gemma3", "phi3"):
        src = save_tiny_arch(tmp_path / "src", arch)
    else:
        src = save_tiny(tmp_path / "src", arch)
    return AutoModelForCausalLM.from_pretrained(src, quantization_config=QuasarConfig(**FAST, **options), dtype=dtype).eval()


def _fused(model) -> list[NormFoldedW8A8Linear]:
    return [m for m in model.modules() if isinstance(m, NormFoldedW8A8Linear)]


@pytest.mark.parametrize(("arch", "backend"), [("llama", "reference"), ("qwen2", "auto"), ("gemma3", "auto"), ("phi3", "auto")])
def test_fused_groups_compute_each_projection_as_the_oracle(tmp_path, arch, backend):
    if backend == "auto":
        require_kernels("w8a8")
    model = _quantized(tmp_path, arch, backend=backend)
    assert len(_fused(model)) == 2 * model.config.num_hidden_layers  # attention and MLP input norms
    names = checkpoint_linears(model)
    x = (torch.randn(1, 5, model.config.hidden_size) * 2).to(torch.bfloat16)
    state = model.state_dict()
    for index, layer in enumerate(model.model.layers):
        for fused in layer.children():
            if not isinstance(fused, NormFoldedW8A8Linear):
                continue
            out = fused(x)
            scale = fused.offset + fused.weight.float()
            for path, _, _ in fused.members:
                key = f"model.layers.{index}.{path}"
                weights = [state.get(f"{key}.{t}") for t in ("weight", "weight_scale", "bias")]
                expected = w8a8_linear_rmsnorm_reference(x, scale, fused.eps, *weights)
                assert torch.equal(layer.get_submodule(path)(out), expected)  # the slice module's columns
                assert names[key] is fused.linear


def test_no_module_holds_another_module_of_the_model(tmp_path):
    """Nothing a module computes reaches another except through tensors it returns."""
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


class _Tagged(torch.Tensor):
    """A tensor subclass with equal values: no module may compute other bits for it."""

    __torch_function__ = torch._C._disabled_torch_function_impl


@needs_kernel
def test_results_do_not_depend_on_the_input_type(tmp_path):
    model = _quantized(tmp_path, "llama")
    fused = _fused(model)[0]
    x = (torch.randn(1, 4, model.config.hidden_size) * 2).to(torch.bfloat16)
    assert torch.equal(fused(x), fused(x.as_subclass(_Tagged)).as_subclass(torch.Tensor))
    assert torch.equal(fused(x), fused(x * 1.0))


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"])
def test_fused_model_is_close_to_the_unfused_one(tmp_path, arch):
    """Same function, one rounding fewer (the norm's output is never rounded): a fraction of W8A8's error."""
    model = _quantized(tmp_path, arch, dtype=torch.float32)
    fused = model(IDS).logits
    state = model.state_dict()
    assert unfuse_projections(model) == 2 * model.config.num_hidden_layers and not _fused(model)
    assert state.keys() == model.state_dict().keys()  # the names never change
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    unfused = model(IDS).logits
    rel = ((fused - unfused).norm() / unfused.norm()).item()
    assert 0 < rel < 1e-2, f"fusion moved the logits by {rel:.2e} (relative)"
    assert fuse_projections(model) == 2 * model.config.num_hidden_layers
    assert torch.equal(model(IDS).logits, fused)
    for _ in range(3):  # split and fused again: the layer keeps one pair of state-dict hooks
        with projections_apart(model):
            assert not _fused(model)
    layer = model.model.layers[0]
    assert len(layer._state_dict_hooks) == 1 and len(layer._load_state_dict_pre_hooks) == 1
    assert state.keys() == model.state_dict().keys() and torch.equal(model(IDS).logits, fused)


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
    assert torch.equal(model(IDS).logits, expected)
    for handle in handles:
        handle.remove()


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
            if not torch.equal(model.generate(prompts[index], max_new_tokens=12, do_sample=False, quasar=True), generated[index]):
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
    fused = _fused(model)[0]
    x = (torch.randn(1, 3, model.config.hidden_size) * 2).to(torch.bfloat16)
    before = fused(x)
    with torch.no_grad():
        fused.linear.weight.neg_()
        fused.weight.mul_(2.0).add_(0.25)
    assert torch.equal(fused(x), before)  # the forward checks nothing: the prepared kernels run
    prepare_weights(model)
    linear = fused.linear
    expected = w8a8_linear_rmsnorm_reference(x, fused.weight.float(), fused.eps, linear.weight, linear.weight_scale, linear.bias)
    assert torch.equal(fused(x), expected) and not torch.equal(expected, before)


@needs_kernel
def test_checkpoints_copies_and_moves_keep_the_fusion_and_the_names(tmp_path):
    model = _quantized(tmp_path, "llama")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert "model.layers.0.self_attn.q_proj.weight" in state and not [k for k in state if ".linear." in k]
    logits = model(IDS).logits
    layer = model.model.layers[0]
    layer_twin = pickle.loads(pickle.dumps(layer))  # a pickled layer prepares its own scale and kernels
    x = torch.randn(1, 4, model.config.hidden_size, dtype=torch.bfloat16)
    assert torch.equal(layer_twin.post_attention_layernorm(x), layer.post_attention_layernorm(x))
    assert layer_twin.state_dict().keys() == layer.state_dict().keys()
    for twin in (copy.deepcopy(model), model.to("cpu")):
        assert len(_fused(twin)) == 2 * model.config.num_hidden_layers
        assert torch.equal(twin(IDS).logits, logits)
    model.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert state.keys() == reloaded.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in reloaded.state_dict().items())
    assert torch.equal(reloaded(IDS).logits, logits)
    reloaded.load_state_dict(state)  # stacked again by the layer's hook, prepared again
    assert torch.equal(reloaded(IDS).logits, logits)
    partial = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    with pytest.raises(RuntimeError, match="self_attn.k_proj.weight"):
        reloaded.load_state_dict(partial)


@needs_kernel
def test_fusion_follows_the_architecture_not_the_smoothing_and_skips_float_members(tmp_path):
    custom = {
        "layers_path": "model.layers",
        "mappings": [{"smooth": "input_layernorm", "balance": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]}],
    }
    smoothed_otherwise = _quantized(tmp_path / "a", "llama", smoothquant_mappings=custom)
    assert len(_fused(smoothed_otherwise)) == 2 * smoothed_otherwise.config.num_hidden_layers  # the spec's groups
    assert_quasar_greedy_equals_plain(smoothed_otherwise, max_new_tokens=12)
    unknown = torch.nn.Module()  # a class with no architecture spec: its layer forward is unknown, nothing fused
    assert fuse_projections(unknown) == 0
    model = _quantized(tmp_path / "b", "llama", modules_to_not_convert=["lm_head", "model.layers.0.mlp.up_proj"])
    assert len(_fused(model)) == 2 * model.config.num_hidden_layers - 1  # layer 0's gate/up group has a float member
    assert_quasar_greedy_equals_plain(model, max_new_tokens=12)


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "phi3"])
def test_greedy_quasar_equals_plain_with_fused_groups(tmp_path, arch):
    model = _quantized(tmp_path, arch)
    assert _fused(model)
    assert_quasar_greedy_equals_plain(model, max_new_tokens=24)


def test_reference_backend_folds_and_decodes_exactly(tmp_path):
    model = _quantized(tmp_path, "llama", backend="reference")
    assert _fused(model)
    assert_quasar_greedy_equals_plain(model, max_new_tokens=12)


@needs_kernel
def test_compiled_graph_calls_the_fused_ops_with_no_pass(tmp_path):
    """Per decoder layer the compiled graph calls two norm-folded ops (q/k/v, gate/up), o_proj and down_proj,
    the same ops eager modules call; no separate norm op for those groups. Compiled need not equal
    eager: within W8A8 error."""
    model = _quantized(tmp_path, "llama")
    seen = []
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(IDS).logits.float()
        compiled = torch.compile(model.forward, fullgraph=True, backend=recording_aot_eager(seen))(input_ids=IDS).logits.float()
    layers = model.config.num_hidden_layers
    assert sum("w8a8_folded_norm_linear_cpu_packed" in t for t in seen) == 2 * layers
    assert sum("quasar.w8a8_linear_cpu_packed" in t for t in seen) == 2 * layers  # o_proj, down_proj
    assert sum("quasar.rms_norm" in t for t in seen) == 1  # the final norm only
    assert ((compiled - eager).norm() / eager.norm()) < 0.05


def test_a_group_whose_norm_output_feeds_something_else_stays_unfused_and_says_so(tmp_path, caplog):
    """The rule fusion rests on, checked by tracing: here layer 0's MLP also reads the normed hidden states
    outside its projections (as a MoE router would), so that group stays unfused; the others fuse."""
    import logging

    from quasar_hf.hf.fusion import unfuse_projections
    from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny

    model = quantize_tiny(make_tiny_checkpoint(tmp_path / "base"))
    unfuse_projections(model)
    model.__dict__.pop("_quasar_fold_check", None)
    mlp = model.model.layers[0].mlp
    plain_forward = mlp.forward
    mlp.forward = lambda x: plain_forward(x) + 0 * x.mean(-1, keepdim=True)  # a "router" on the norm's output
    with caplog.at_level(logging.INFO, logger="quasar_hf.hf.fusion"):
        fused = fuse_projections(model)
    assert fused == 2 * 2 - 2  # the post-attention group stays unfused in every layer (the rule is the class's)
    assert "fused 2 of 4 norm + projection groups; first not fused: layer 0 post_attention_layernorm" in caplog.text
    assert "also passes post_attention_layernorm's output to mean" in caplog.text
    assert isinstance(model.model.layers[0].input_layernorm, NormFoldedW8A8Linear)
    assert not isinstance(model.model.layers[0].post_attention_layernorm, NormFoldedW8A8Linear)


def test_unpickling_prepares_real_tensors_and_keeps_placeholders_as_pickled():
    """A pickle's twin packs its own layout from its tensors; a state whose tensors are placeholders (Dynamo's
    guard-state pickle of a traced step) is kept as pickled, layout included, and nothing is prepared."""
    linear = W8A8Linear.from_linear(torch.nn.Linear(64, 32, bias=True))
    x = torch.randn(3, 64)
    twin = pickle.loads(pickle.dumps(linear))
    assert torch.equal(twin(x), linear(x))
    assert twin._op_layout[0] == linear._op_layout[0] and twin._prepared is not None
    assert all(not (isinstance(a, torch.Tensor) and a is b) for a, b in zip(twin._op_layout[1], linear._op_layout[1]))
    state = linear.__getstate__()
    assert state["_prepared"] is None and state["_op_layout"] is linear._op_layout
    placeholder = object()
    state = {**state, "_buffers": dict.fromkeys(state["_buffers"], placeholder)}
    rebuilt = W8A8Linear.__new__(W8A8Linear)
    rebuilt.__setstate__(state)
    assert rebuilt._op_layout is linear._op_layout and rebuilt._prepared is None and rebuilt.weight is placeholder
