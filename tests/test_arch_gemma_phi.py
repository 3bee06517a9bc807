"""Gemma 3 and Phi-3 on tiny random models: exact smoothing, quantize-on-load, sliding windows.

Gemma 3: (1 + w) RMSNorms, pre/post-feedforward norms, q/k norms, sliding + global attention
layers. Phi-3: fused qkv_proj and gate_up_proj.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig, W8A8Linear, is_quasar_model
from quasar_hf.smoothquant.mappings import SMOOTHQUANT_MAPPINGS, SmoothMapping, decoder_layers, resolve_mappings
from quasar_hf.smoothquant.smoothing import smooth_mapping
from tests.helpers.tiny_archs import TINY, WINDOW, save_tiny_arch, tiny_gemma3, tiny_phi3

IDS = torch.tensor([[5, 17, 33, 2, 71, 40, 9, 88, 12, 3, 64, 21, 7, 90, 45, 30, 11, 58, 77, 26]])


@torch.no_grad()
def balance_input_absmax(model, ids) -> list[dict[str, torch.Tensor]]:
    """Per decoder layer: balance linear path -> abs-max of its input per channel [K]."""
    arch = resolve_mappings(model)
    layers = decoder_layers(model, arch)
    stats: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    handles = []
    for index, layer in enumerate(layers):
        for mapping in arch.mappings:
            path = mapping.balance[0]

            def hook(module, args, index=index, path=path):
                stats[index][path] = args[0].reshape(-1, args[0].shape[-1]).abs().amax(0)

            handles.append(layer.get_submodule(path).register_forward_pre_hook(hook))
    model(ids)
    for handle in handles:
        handle.remove()
    return stats


@torch.no_grad()
def smooth_in_place(model, mappings, ids, alpha: float = 0.8) -> None:
    """Smooth every layer with `mappings` (statistics inflated per channel so s is far from 1)."""
    stats = balance_input_absmax(model, ids)
    gen = torch.Generator().manual_seed(3)
    for layer, layer_stats in zip(decoder_layers(model, resolve_mappings(model)), stats):
        float_weights = {n: m.weight.float().clone() for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
        for mapping in mappings:
            absmax = layer_stats[mapping.balance[0]] * torch.exp(
                2 * torch.randn(layer_stats[mapping.balance[0]].shape, generator=gen)
            )
            result = smooth_mapping(layer, mapping, absmax, None, alpha, [], float_weights)
            assert result.prescale == {}, f"{mapping.smooth} should fold, not fall back to a pre-scale"
        for name, weight in float_weights.items():
            layer.get_submodule(name).weight.copy_(weight)


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_fp32_smoothing_leaves_outputs_unchanged(arch):
    model = TINY[arch]()
    mappings = SMOOTHQUANT_MAPPINGS[type(model).__name__].mappings
    before = {n: p.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        ref = model(IDS).logits
    smooth_in_place(model, mappings, IDS)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert any("input_layernorm" in n for n in changed) and any("o_proj" in n for n in changed)
    assert any("down_proj" in n for n in changed)
    with torch.no_grad():
        got = model(IDS).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_gemma3_smoothing_needs_the_one_plus_w_fold():
    """Control: treating Gemma's (1 + w) norm as a plain w norm changes the function (the test can fail)."""
    model = tiny_gemma3()
    wrong = tuple(SmoothMapping(m.smooth, m.balance, m.kind) for m in SMOOTHQUANT_MAPPINGS["Gemma3ForCausalLM"].mappings)
    with torch.no_grad():
        ref = model(IDS).logits
    smooth_in_place(model, wrong, IDS)
    with torch.no_grad():
        assert (model(IDS).logits - ref).abs().max() > 1e-2


def test_phi3_fused_rows_only_the_v_and_up_slices_are_scaled():
    model = tiny_phi3()
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv, gate_up = attn.qkv_proj.weight.clone(), mlp.gate_up_proj.weight.clone()
    smooth_in_place(model, SMOOTHQUANT_MAPPINGS["Phi3ForCausalLM"].mappings, IDS)
    q_and_k = 64 + 2 * 16  # 4 query heads + 2 KV heads of 16
    changed_qkv = (attn.qkv_proj.weight != qkv).any(dim=1)  # rows; columns also scaled by the norm's s
    assert changed_qkv.all()  # the input_layernorm mapping scales every column
    # Row factors only on v: undo the column scaling by comparing row ratios.
    ratio = attn.qkv_proj.weight / qkv  # [rows, K] = s_col[k] (all rows) * 1/s_row (v rows only)
    col = ratio[:q_and_k].mean(0)
    assert torch.allclose(ratio[:q_and_k], col.expand(q_and_k, -1), rtol=1e-5)
    assert not torch.allclose(ratio[q_and_k:], col.expand(ratio.shape[0] - q_and_k, -1), rtol=1e-3)
    up = mlp.gate_up_proj.weight / gate_up  # gate rows: column factors only
    assert torch.allclose(up[:128], up[:128].mean(0).expand(128, -1), rtol=1e-5)
    assert not torch.allclose(up[128:], up[:128].mean(0).expand(128, -1), rtol=1e-3)


FAST = dict(num_calibration_samples=4, calibration_seq_len=64)


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
@pytest.mark.parametrize("alpha", [0.5, "auto"])
def test_quantize_on_load(tmp_path, arch, alpha):
    src = save_tiny_arch(tmp_path / "src", arch)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=QuasarConfig(alpha=alpha, **FAST), dtype=torch.float32)
    assert is_quasar_model(model)
    leftover = [n for n, m in model.named_modules() if n.startswith("model.layers.") and type(m) is torch.nn.Linear]
    assert leftover == []
    assert not model.config.quantization_config.prescaled_modules  # every mapping folded
    with torch.no_grad():
        ref = TINY[arch]()(IDS).logits
        got = model(IDS).logits
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 0.05, f"W8A8 logits too far from float: relative error {rel:.4f}"
    model.save_pretrained(tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert sum(isinstance(m, W8A8Linear) for m in reloaded.modules()) == sum(isinstance(m, W8A8Linear) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, got)


# ---- sliding windows: row-stable attention and speculative decoding ---------------------------


def window_mask(q_len: int, kv_len: int, window: int) -> torch.Tensor:
    """Transformers' sliding causal mask [1, 1, Q, N]: row i (key index N - Q + i) sees the last `window` keys."""
    rows = torch.arange(kv_len - q_len, kv_len)[:, None]
    cols = torch.arange(kv_len)[None, :]
    return ((cols <= rows) & (cols > rows - window))[None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowstable_attention_rows_equal_sliding_window_decode_steps(dtype):
    """A verify call over a full cache with a window mask gives, row for row, the bits of a decode step
    over a sliding cache layer (only the last `window` keys, no mask)."""
    from types import SimpleNamespace

    from quasar_hf.ops.reference import attention_reference
    from quasar_hf.ops.rowstable_attention import rowstable_attention_forward

    module = SimpleNamespace(is_causal=True)
    gen = torch.Generator().manual_seed(0)
    q_len, kv_len, scale = 5, 30, 0.25
    q = torch.randn(1, 4, q_len, 16, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, kv_len, 16, generator=gen).to(dtype) for _ in range(2))
    mask = window_mask(q_len, kv_len, WINDOW)
    verify, _ = rowstable_attention_forward(module, q, k, v, mask, scaling=scale, sliding_window=WINDOW)
    last, _ = rowstable_attention_forward(module, q[:, :, -1:], k, v, None, scaling=scale, sliding_window=WINDOW)
    assert torch.equal(last[:, 0], verify[:, -1])  # the window holds even when no mask comes with the call
    for i in range(q_len):
        end = kv_len - q_len + 1 + i
        keys, values = k[:, :, end - WINDOW : end], v[:, :, end - WINDOW : end]
        step, _ = rowstable_attention_forward(
            module, q[:, :, i : i + 1], keys, values, None, scaling=scale, sliding_window=WINDOW
        )
        assert torch.equal(verify[:, i], step[:, 0]), f"row {i} differs from its decode step"
    reference = attention_reference(q, k, v, mask[:, 0], scale).to(dtype)  # [B, Q, H, D]
    torch.testing.assert_close(
        verify.float(),
        reference.float(),
        rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
        atol=1e-2 if dtype == torch.bfloat16 else 1e-5,
    )


@pytest.fixture(scope="module")
def quantized_gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    src = save_tiny_arch(path / "src", "gemma3")
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=QuasarConfig(alpha=0.5, **FAST), dtype=torch.float32)
    model.save_pretrained(path / "w8a8")
    return path / "w8a8"


PROMPTS = [
    IDS[:, :12],
    torch.tensor([[3, 9, 27, 81, 50, 22, 66, 71, 5, 15, 45, 8, 24, 72, 89, 40, 33, 99, 14, 42, 3, 9, 27, 81]]),
]


@pytest.mark.parametrize("attention", ["quasar_rowstable", "sdpa"])
def test_gemma3_greedy_quasar_equals_plain_past_the_window(quantized_gemma3, attention):
    """Prompts and generations run well past the window (8): rejected drafts are cropped from a cache
    whose sliding layers have already moved on, and every token matches plain greedy decoding."""
    model = AutoModelForCausalLM.from_pretrained(quantized_gemma3).eval()
    if attention == "sdpa":
        model.set_attn_implementation("sdpa")
    rejected = 0
    for ids in PROMPTS:
        plain = model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, quasar=False)
        for quasar in ({"drafter": "ngram"}, {"drafter": "ngram", "num_draft_tokens": 3, "min_ngram_size": 1}):
            out = model.generate(
                ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, quasar=quasar, return_dict_in_generate=True
            )
            assert torch.equal(out.sequences, plain), f"{attention} {quasar}: speculative output differs from plain greedy"
            stats = out.quasar_stats
            assert stats.verify_steps > 0
            rejected += stats.drafted_tokens - stats.accepted_tokens
    assert rejected > 0, "no draft was ever rejected: the rollback path was not exercised"


def test_gemma3_batch_with_holes_is_refused(quantized_gemma3):
    model = AutoModelForCausalLM.from_pretrained(quantized_gemma3).eval()
    ids = torch.tensor([[96, 96, 5, 17, 33, 2, 71, 40], [9, 88, 12, 3, 64, 21, 7, 90]])
    mask = (ids != 96).long()
    with pytest.raises(ValueError, match="sliding-window"):
        model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, quasar=True)
