"""device_map placement of a Quasar checkpoint (Accelerate): on CPU the multi-device mechanics are
tested with a map over "cpu" and "disk" (offload_folder); logits and Quasar generation must match
the model loaded in one piece. Norms that accelerate dispatches are not folded into the W8A8
quantization (nn/norm_folded_linear.py), so the model in one piece is compared with its fusion undone."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf.hf.fusion import unfuse_projections
from quasar_hf.nn import NormFoldedW8A8Linear
from tests.helpers.hub import make_tiny_checkpoint, quantize_tiny

pytest.importorskip("accelerate", reason="device_map needs accelerate")

DEVICE_MAP = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quasar")
    quantize_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("base"))).save_pretrained(folder)
    return folder


def test_cpu_and_disk_map_gives_identical_logits_and_generation(saved, tmp_path):
    whole = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    spread = AutoModelForCausalLM.from_pretrained(
        saved, dtype=torch.float32, device_map=DEVICE_MAP, offload_folder=str(tmp_path / "offload")
    ).eval()
    assert spread.hf_device_map == DEVICE_MAP
    assert spread.model.layers[1].input_layernorm.weight.device.type == "meta"  # really offloaded
    assert type(spread.model.layers[1].mlp.down_proj).__name__ == "RotatedW8A8Linear"  # the default rotate=["down_proj"]
    assert type(spread.lm_head).__name__ == "RowStableLinear"  # re-hooked by accelerate, same bits as `whole`
    assert any(isinstance(m, NormFoldedW8A8Linear) for m in whole.modules())
    assert not any(isinstance(m, NormFoldedW8A8Linear) for m in spread.modules())  # accelerate owns their forward
    unfuse_projections(whole)  # the same function, computed norm first: `spread`'s bits
    ids = torch.randint(0, 250, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(spread(ids).logits, whole(ids).logits)
        assert torch.equal(
            spread.generate(ids, max_new_tokens=8, do_sample=False, quasar=True),
            whole.generate(ids, max_new_tokens=8, do_sample=False, quasar=True),
        )


def test_quantizing_with_an_offloaded_layer_equals_quantizing_in_one_piece(tmp_path):
    """A device_map that offloads a decoder layer ("disk" here; "cpu" beside a GPU is the same accelerate
    mechanism) quantizes: the offloaded layer is materialized for its turn and stays resident after, and the
    result has the bits of the model quantized in one piece."""
    from tests.helpers.hub import quantize_tiny

    base = make_tiny_checkpoint(tmp_path / "base")
    whole = quantize_tiny(base)
    spread = quantize_tiny(base, device_map=DEVICE_MAP, offload_folder=str(tmp_path / "offload"))
    assert spread.model.layers[1].mlp.down_proj.weight.device.type == "cpu"  # resident now: int8, half the bytes
    ids = torch.randint(0, 250, (1, 16), generator=torch.Generator().manual_seed(0))
    unfuse_projections(whole)  # accelerate dispatches `spread`'s layers, so they are not fused (computed norm first)
    with torch.no_grad():
        assert torch.equal(spread(ids).logits, whole(ids).logits)
        assert torch.equal(  # the re-dispatched layer leaves the KV cache where it is
            spread.generate(ids, max_new_tokens=8, do_sample=False, quasar=True),
            whole.generate(ids, max_new_tokens=8, do_sample=False, quasar=True),
        )
    spread.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    unfuse_projections(reloaded)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, whole(ids).logits)
