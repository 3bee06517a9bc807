"""Nothing lost, nothing silently wrong: offloaded modules of every kind quantize, save and resume;
float tensors never load into int8 weights; training is refused; fused projections name the way out."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig
from quasar_hf.hf import sequential
from quasar_hf.hf.fusion import projections_apart
from quasar_hf.smoothquant.placement import check_calibration_device_here
from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny

pytest.importorskip("accelerate", reason="device_map needs accelerate")

PLACES = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "cpu",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


def on_disk(*modules: str) -> dict:
    return {**PLACES, **dict.fromkeys(modules, "disk")}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def one_piece(base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("whole")
    quantize_tiny(base).save_pretrained(folder)
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    "modules", [("model.norm",), ("model.layers.1",), ("model.embed_tokens", "lm_head")], ids=["norm", "layer", "tied-embeddings"]
)
def test_a_module_offloaded_to_disk_quantizes_saves_and_reloads_the_one_piece_tensors(base, one_piece, modules, tmp_path):
    """The tiny model ties lm_head to the embeddings, which accelerate then places together."""
    model = quantize_tiny(base, device_map=on_disk(*modules), offload_folder=str(tmp_path / "offload"))
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    # After a forward, accelerate hands an offloaded tied head a Parameter of its own, so Transformers saves
    # lm_head.weight too (plain Transformers does the same): the embeddings' values, tied again on reload.
    extra = saved.keys() - one_piece.keys()
    assert extra <= {"lm_head.weight"} and all(torch.equal(saved[k], saved["model.embed_tokens.weight"]) for k in extra)
    assert [k for k in one_piece if not torch.equal(saved[k], one_piece[k])] == []
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)  # digests checked
    assert reloaded.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, do_sample=False, quasar=True).shape == (1, 8)


def test_a_killed_run_with_an_offloaded_layer_resumes_to_the_one_piece_tensors(base, one_piece, tmp_path, monkeypatch):
    state = str(tmp_path / "state")
    swap = sequential.swap_in_w8a8
    calls = {"n": 0}

    def dying_swap(*args, **kwargs):
        if calls["n"] == 1:
            raise KeyboardInterrupt("killed during layer 1")
        calls["n"] += 1
        return swap(*args, **kwargs)

    spread = dict(device_map=on_disk("model.layers.1"), offload_folder=str(tmp_path / "offload"), resume_dir=state)
    monkeypatch.setattr(sequential, "swap_in_w8a8", dying_swap)
    with pytest.raises(KeyboardInterrupt):
        quantize_tiny(base, **spread)
    monkeypatch.setattr(sequential, "swap_in_w8a8", swap)
    model = quantize_tiny(base, **spread)
    assert "resume_restore" in model.config.quantization_config.calibration_info["timing"]["total_s"]
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert [k for k in one_piece if not torch.equal(saved[k], one_piece[k])] == []


@pytest.fixture()
def quantized(base):
    return quantize_tiny(base)


def test_a_float_tensor_for_an_int8_weight_is_refused_by_name_and_nothing_loads(quantized):
    before = {k: v.clone() for k, v in quantized.state_dict().items()}
    for key in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):  # unfused, fused
        edited = dict(before)
        edited[key] = before[key].float() * 1.5
        with pytest.raises(ValueError, match=rf"{key}: a float32 tensor cannot load into this int8 W8A8 weight"):
            quantized.load_state_dict(edited)
        with pytest.raises(ValueError, match=key.removeprefix("model.layers.0.")):
            quantized.model.layers[0].load_state_dict(
                {k[len("model.layers.0.") :]: v for k, v in edited.items() if "layers.0." in k}
            )
    after = quantized.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_the_float_models_state_dict_is_refused_even_with_strict_false(quantized, base):
    before = {k: v.clone() for k, v in quantized.state_dict().items()}
    original = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    with pytest.raises(ValueError, match=r"model\.layers\.0\..*\.weight: a float32 tensor cannot load"):
        quantized.load_state_dict(original, strict=False)
    after = quantized.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_a_member_with_the_wrong_row_count_is_named_by_its_own_key(quantized):
    state = quantized.state_dict()
    state["model.layers.1.self_attn.k_proj.weight"] = state["model.layers.1.self_attn.k_proj.weight"][:-1]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight: an int8 tensor of shape \[31, 64\]"):
        quantized.load_state_dict(state)


def test_training_is_refused_at_train_and_at_a_raw_backward(quantized):
    with pytest.raises(ValueError, match=r"model\.train\(\): a Quasar W8A8 model is for inference only"):
        quantized.train()
    assert quantized.eval() is quantized and not quantized.training
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out = quantized(ids, labels=ids)
    with pytest.raises(RuntimeError, match="backward through a Quasar model"):
        out.loss.backward()
    assert all(p.grad is None for p in quantized.parameters())
    with torch.no_grad():  # inference is untouched
        assert torch.equal(quantized(ids).logits, out.logits.detach())


def test_a_fused_projection_names_projections_apart(quantized):
    q_proj = quantized.model.layers[0].self_attn.q_proj
    assert (q_proj.in_features, q_proj.out_features) == (64, 64)
    for name in ("weight", "bias", "weight_scale"):
        with pytest.raises(AttributeError, match="projections_apart"):
            getattr(q_proj, name)
    assert not hasattr(q_proj, "weight")
    with projections_apart(quantized):
        assert quantized.model.layers[0].self_attn.q_proj.weight.dtype == torch.int8
    norm = quantized.model.layers[0].input_layernorm
    with pytest.warns(UserWarning, match=r"receives its projections \[\.\.\., 128\].*projections_apart"):
        norm.register_forward_hook(lambda *args: None).remove()


def test_safetensors_only_is_said_not_ignored(quantized, tmp_path):
    with pytest.raises(ValueError, match="safetensors only.*drop safe_serialization=False"):
        quantized.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert not (tmp_path / "bin").exists()


@pytest.mark.parametrize(
    "device, message",
    [("cpu:1", "the CPU takes no index"), ("cuda", "sees no cuda device"), ("cuda:7", "sees no cuda device")],
)
def test_a_calibration_device_this_machine_lacks_is_refused_before_any_work(device, message, base):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: these devices may exist here")
    with pytest.raises(ValueError, match=message):
        check_calibration_device_here(device)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(base, quantization_config=QuasarConfig(calibration_device=device))
