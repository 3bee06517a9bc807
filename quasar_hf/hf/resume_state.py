"""Resume a layer-by-layer quantization after a kill: the state after each finished layer, on disk.

After decoder layer i is quantized, `ResumeState.save_layer` writes into its folder (beside the
output: `quasar-hf quantize` uses OUT.partial):

- `layer_00i.safetensors`: the finished layer's tensors (int8 weights, scales, biases, the norms
  smoothing changed), with the kind of each quantized linear in the header;
- `hidden_00(i+1).safetensors`: the calibration hidden states that feed layer i+1;
- `progress.json`, last: the next layer, what the run has gathered so far (alphas, rotated and
  prescaled names), the sampling generator's state, and a fingerprint of everything the result
  depends on. Each file is written to a temporary name and renamed, so a kill at any moment leaves
  the previous state whole.

A rerun with the same model and settings finds the fingerprint equal, rebuilds layers 0..i from
their files, and continues at layer i+1 with the same hidden states and generator state: the
result is bit-identical to an uninterrupted run. Other settings start from layer 0.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from quasar_hf.nn import RotatedW8A8Linear, W8A8Linear

PROGRESS = "progress.json"
STATE_FORMAT = 2  # 2: fp32 calibration rounds activations to the model dtype


def fingerprint(parts: dict) -> str:
    """SHA-256 of a JSON description of everything the quantized result depends on."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _atomic_write(path: str, write) -> None:
    folder = os.path.dirname(path)
    handle, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    os.close(handle)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class ResumeState:
    """The state folder of one quantization run (see the module docstring)."""

    def __init__(self, folder: str, key: str) -> None:
        self.folder = folder
        self.key = key
        os.makedirs(folder, exist_ok=True)

    def progress(self) -> dict | None:
        """The saved progress when it belongs to this run (same fingerprint), else None."""
        path = os.path.join(self.folder, PROGRESS)
        if not os.path.isfile(path):
            return None
        try:
            with open(path) as f:
                saved = json.load(f)
        except (OSError, json.JSONDecodeError):
            return None
        if saved.get("format") != STATE_FORMAT or saved.get("fingerprint") != self.key:
            return None
        return saved

    def save_layer(
        self, index: int, layer: nn.Module, hidden: list[torch.Tensor], generator: torch.Generator, gathered: dict
    ) -> None:
        """Layer `index` is finished and `hidden` feeds layer index + 1."""
        kinds = {
            name: "rotated" if isinstance(m, RotatedW8A8Linear) else "w8a8"
            for name, m in layer.named_modules()
            if isinstance(m, W8A8Linear)
        }
        tensors = {name: t.detach().cpu().contiguous() for name, t in layer.state_dict().items()}
        _atomic_write(self._layer_path(index), lambda p: save_file(tensors, p, metadata={"kinds": json.dumps(kinds)}))
        stacked = {f"block_{i}": h.detach().cpu().contiguous() for i, h in enumerate(hidden)}
        _atomic_write(self._hidden_path(index + 1), lambda p: save_file(stacked, p))
        progress = {
            "format": STATE_FORMAT,
            "fingerprint": self.key,
            "next_layer": index + 1,
            "gathered": gathered,
            "generator": base64.b64encode(generator.get_state().numpy().tobytes()).decode(),
        }
        _atomic_write(os.path.join(self.folder, PROGRESS), lambda p: _write_json(p, progress))
        stale = self._hidden_path(index)
        if os.path.exists(stale):
            os.remove(stale)

    def restore_layer(self, index: int, layer: nn.Module, backend: str, bias_dtype: torch.dtype) -> None:
        """Put the finished layer `index` back: W8A8 modules where it had them, then all its tensors."""
        path = self._layer_path(index)
        with safe_open(path, framework="pt") as handle:
            kinds = json.loads(handle.metadata()["kinds"])
        tensors = load_file(path)
        for name, kind in kinds.items():
            linear = layer.get_submodule(name)
            cls = RotatedW8A8Linear if kind == "rotated" else W8A8Linear
            module = cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                has_act_prescale=f"{name}.act_prescale" in tensors,
                backend=backend,
                bias_dtype=bias_dtype,
                device=linear.weight.device,
            )
            parent, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, child, module)
        layer.load_state_dict(tensors, strict=True)
        for module in layer.modules():
            if isinstance(module, W8A8Linear):
                module.prepare()

    def restore_run(self, progress: dict, generator: torch.Generator) -> list[torch.Tensor]:
        """The hidden states feeding the next layer; sets `generator` to the saved state."""
        raw = base64.b64decode(progress["generator"])
        generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        saved = load_file(self._hidden_path(progress["next_layer"]))
        return [saved[f"block_{i}"] for i in range(len(saved))]

    def _layer_path(self, index: int) -> str:
        return os.path.join(self.folder, f"layer_{index:04d}.safetensors")

    def _hidden_path(self, index: int) -> str:
        return os.path.join(self.folder, f"hidden_{index:04d}.safetensors")


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
