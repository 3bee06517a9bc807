"""A saved checkpoint's config.json is checked against its tensors at load (hf/checkpoint_checks.py).

Every field of `quantization_config` that changes the math, with one entry removed or added in
turn, makes the load fail with a message naming that field; an unedited copy loads with the same
logits; a checkpoint saved before the layout record loads as before.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig
from quasar_hf.hf.checkpoint_checks import LAYOUT_KEY
from tests.helpers.tiny_models import save_tiny

IDS = torch.arange(3, 40)[None]
FAST = dict(num_calibration_samples=4, calibration_seq_len=64, weight_rounding="nearest")
KEPT = "model.layers.1.mlp.up_proj"
# down_proj smoothed through the MLP's activation (no weight to fold into): it carries an act_prescale.
PRESCALING = {"layers_path": "model.layers", "mappings": [{"smooth": "mlp.act_fn", "balance": ["mlp.down_proj"], "kind": "norm"}]}


def quantize_and_save(src: str, out, **options) -> str:
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=QuasarConfig(**FAST, **options), dtype=torch.float32)
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    """Two tiny checkpoints: rotated o/down + a kept linear + a draft layer; SmoothQuant only with
    prescaled down_projs + a draft layer with a reduced vocabulary."""
    root = tmp_path_factory.mktemp("saved")
    src = save_tiny(root / "src")
    return {
        "rotated": quantize_and_save(src, root / "rotated", rotate=["down_proj", "o_proj"], keep_float=[KEPT], draft_layers=[0]),
        "prescaled": quantize_and_save(
            src, root / "prescaled", rotate=[], smoothquant_mappings=PRESCALING, draft_layers=[1], draft_vocab_size=64
        ),
    }


def edited_copy(source: str, dest, edit) -> str:
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    edit(config["quantization_config"])
    (dest / "config.json").write_text(json.dumps(config))
    return str(dest)


def first_not_in(names: list[str], taken: list[str]) -> str:
    return next(n for n in names if n not in taken)


# (checkpoint, what the edit does, the field the refusal must name, the edit)
EDITS = [
    ("rotated", "rotated_modules - 1", "rotated_modules", lambda q: q["rotated_modules"].pop(0)),
    (
        "rotated",
        "rotated_modules + 1",
        "rotated_modules",
        lambda q: q["rotated_modules"].append(first_not_in(q["quantized_modules"], q["rotated_modules"])),
    ),
    ("rotated", "rotation sizes - 1", "rotation", lambda q: q["rotation_info"]["sizes"].popitem()),
    ("rotated", "rotation sizes + 1", "rotation_info.sizes", lambda q: q["rotation_info"]["sizes"].update({"32": [1, 1, 32]})),
    ("rotated", "keep_float + 1", "keep_float", lambda q: q["keep_float"].append(q["quantized_modules"][0])),
    ("rotated", "keep_float_info.modules - 1", "keep_float_info.modules", lambda q: q["keep_float_info"]["modules"].pop()),
    (
        "rotated",
        "keep_float_info.modules + 1",
        "keep_float_info.modules",
        lambda q: q["keep_float_info"]["modules"].append(q["quantized_modules"][0]),
    ),
    ("rotated", "draft_info.layers - 1", "draft_info.layers", lambda q: q["draft_info"]["layers"].pop()),
    ("rotated", "draft_info.layers + 1", "draft_info.layers", lambda q: q["draft_info"]["layers"].append(1)),
    ("rotated", "draft_layers + 1", "draft_layers", lambda q: q["draft_layers"].append(1)),
    ("rotated", "draft_info.dtype", "draft_info.dtype", lambda q: q["draft_info"].update(dtype="int8")),
    ("rotated", "draft_vocab_size added", "draft_vocab_size", lambda q: q.update(draft_vocab_size=64)),
    ("rotated", "quantized_modules - 1", "quantized_modules", lambda q: q["quantized_modules"].pop(0)),
    ("rotated", "quantized_modules + 1", "quantized", lambda q: q["quantized_modules"].append(KEPT)),
    ("prescaled", "prescaled_modules - 1", "prescaled_modules", lambda q: q["prescaled_modules"].pop()),
    (
        "prescaled",
        "prescaled_modules + 1",
        "prescaled_modules",
        lambda q: q["prescaled_modules"].append(q["quantized_modules"][0]),
    ),
    ("prescaled", "rotated_modules + 1", "rotated_modules", lambda q: q["rotated_modules"].append(q["quantized_modules"][0])),
    ("prescaled", "draft_info.vocab_size", "draft_info.vocab_size", lambda q: q["draft_info"].update(vocab_size=32)),
    ("prescaled", "draft_vocab_size", "draft_vocab_size", lambda q: q.update(draft_vocab_size=None)),
    ("rotated", "alpha", "alpha", lambda q: q.update(alpha=0.5)),
    ("rotated", "rotate", "rotate", lambda q: q.update(rotate=["down_proj"])),
    ("rotated", "weight_rounding", "weight_rounding", lambda q: q.update(weight_rounding="gptq")),
    (
        "prescaled",
        "modules_to_not_convert",
        "modules_to_not_convert",
        lambda q: q.update(modules_to_not_convert=["lm_head", "gate_proj"]),
    ),
]


@pytest.mark.parametrize("checkpoint,label,field,edit", EDITS, ids=[e[1] + " (" + e[0] + ")" for e in EDITS])
def test_every_math_field_edited_by_one_entry_is_refused_naming_it(saved, tmp_path, checkpoint, label, field, edit):
    folder = edited_copy(saved[checkpoint], tmp_path / "edited", edit)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(folder)


def test_the_prescaled_checkpoint_really_has_what_its_edits_remove(saved):
    config = json.loads(open(f"{saved['prescaled']}/config.json").read())["quantization_config"]
    assert config["prescaled_modules"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert config["draft_info"]["vocab_size"] == 64


def test_an_unedited_copy_loads_with_the_same_logits_and_the_record_describes_the_tensors(saved, tmp_path):
    from safetensors import safe_open

    folder = edited_copy(saved["rotated"], tmp_path / "same", lambda q: None)
    with torch.no_grad():
        assert torch.equal(
            AutoModelForCausalLM.from_pretrained(folder)(IDS).logits,
            AutoModelForCausalLM.from_pretrained(saved["rotated"])(IDS).logits,
        )
    with safe_open(f"{folder}/model.safetensors", framework="pt") as handle:
        layout = json.loads(handle.metadata()[LAYOUT_KEY])
    assert layout["rotated_modules"] == {
        "model.layers.0.mlp.down_proj": 128,
        "model.layers.0.self_attn.o_proj": 64,
        "model.layers.1.mlp.down_proj": 128,
        "model.layers.1.self_attn.o_proj": 64,
    }
    assert layout["keep_float"] == [KEPT] and layout["draft_layers"] == [0]


def rewrite_tensors(folder: str, change=None, metadata: dict | None = None) -> None:
    path = f"{folder}/model.safetensors"
    tensors = load_file(path)
    if change:
        change(tensors)
    save_file(tensors, path, metadata=metadata or {"format": "pt"})


def test_a_checkpoint_without_the_record_loads_as_before_and_a_save_adds_it(saved, tmp_path, caplog):
    folder = edited_copy(saved["rotated"], tmp_path / "old", lambda q: None)
    rewrite_tensors(folder)  # as saved before the layout record existed
    with caplog.at_level("WARNING"):
        model = AutoModelForCausalLM.from_pretrained(folder)
    assert "predates the layout record" in caplog.text
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, AutoModelForCausalLM.from_pretrained(saved["rotated"])(IDS).logits)
    model.save_pretrained(tmp_path / "resaved")
    edited = edited_copy(str(tmp_path / "resaved"), tmp_path / "resaved_edit", lambda q: q["rotated_modules"].pop())
    with pytest.raises(ValueError, match="rotated_modules"):
        AutoModelForCausalLM.from_pretrained(edited)


def test_shards_from_different_saves_are_refused(saved, tmp_path):
    folder = edited_copy(saved["rotated"], tmp_path / "mixed", lambda q: None)
    rewrite_tensors(folder, metadata={"format": "pt", LAYOUT_KEY: "{not json"})
    with pytest.raises(ValueError, match="not JSON"):
        AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("suffix,shape", [("weight_scale", (63,)), ("weight_scale", (64, 1)), ("act_prescale", (64,))])
def test_a_misshaped_scale_gets_a_quasar_message(saved, tmp_path, suffix, shape):
    name = "model.layers.1.mlp.down_proj" if suffix == "act_prescale" else "model.layers.0.self_attn.q_proj"
    folder = edited_copy(saved["prescaled"], tmp_path / "shape", lambda q: None)
    rewrite_tensors(
        folder,
        lambda t: t.update({f"{name}.{suffix}": torch.ones(shape)}),
        {"format": "pt", LAYOUT_KEY: _layout(saved["prescaled"])},
    )
    with pytest.raises(ValueError, match=rf"'{name}\.{suffix}' has shape \[.*one scale per"):
        AutoModelForCausalLM.from_pretrained(folder)


def _layout(folder: str) -> str:
    from safetensors import safe_open

    with safe_open(f"{folder}/model.safetensors", framework="pt") as handle:
        return handle.metadata()[LAYOUT_KEY]


def test_bytes_changed_on_disk_are_refused_naming_the_tensor_unless_checks_are_off(saved, tmp_path, monkeypatch):
    """Random bytes written into the middle of the tensor data (safetensors has no checksum of its own)."""
    from quasar_hf.hf.checksums import DIGESTS_KEY, check_file_digests

    folder = edited_copy(saved["rotated"], tmp_path / "flipped", lambda q: None)
    path = f"{folder}/model.safetensors"
    assert check_file_digests(path) == len(load_file(path))  # every stored tensor has its digest
    data = bytearray(open(path, "rb").read())
    middle = len(data) // 2
    data[middle : middle + 4096] = (
        torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).to(torch.uint8).numpy().tobytes()
    )
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors: the bytes of tensor '.+' do not match the SHA-256"):
        AutoModelForCausalLM.from_pretrained(folder)
    monkeypatch.setenv("QUASAR_VERIFY_CHECKSUMS", "0")
    AutoModelForCausalLM.from_pretrained(folder)  # the user's call: loads the changed bytes
    assert DIGESTS_KEY in open(path, "rb").read(20000).decode("latin-1")


def test_a_renamed_or_thinned_digest_entry_is_refused_not_skipped(saved, tmp_path):
    """A header with a layout record always carries every tensor's SHA-256: renaming the entry (which
    used to turn verification off) or dropping one tensor's digest is refused, naming the file."""
    from safetensors import safe_open

    from quasar_hf.hf.checksums import DIGESTS_KEY

    def rewritten(name: str, edit) -> str:
        folder = edited_copy(saved["rotated"], tmp_path / name, lambda q: None)
        path = f"{folder}/model.safetensors"
        with safe_open(path, framework="pt") as handle:
            metadata = dict(handle.metadata())
        tensors = load_file(path)
        edit(metadata)
        save_file(tensors, path, metadata=metadata)
        return folder

    renamed = rewritten("renamed", lambda m: m.update(renamed_sha256=m.pop(DIGESTS_KEY)))
    with pytest.raises(ValueError, match=rf"model\.safetensors: its header has no {DIGESTS_KEY} entry.*edited"):
        AutoModelForCausalLM.from_pretrained(renamed)

    def drop_one(metadata):
        digests = json.loads(metadata[DIGESTS_KEY])
        digests.pop(sorted(digests)[0])
        metadata[DIGESTS_KEY] = json.dumps(digests)

    thinned = rewritten("thinned", drop_one)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor '.+' has no SHA-256"):
        AutoModelForCausalLM.from_pretrained(thinned)
