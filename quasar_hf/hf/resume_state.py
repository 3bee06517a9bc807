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

progress.json also records the SHA-256 of every state file. A rerun with the same model and
settings finds the fingerprint equal, checks each file against its digest, rebuilds layers 0..i
from the bytes it checked, and continues at layer i+1 with the same hidden states and generator
state: the result is bit-identical to an uninterrupted run. A state of other settings, or one whose
files are missing, truncated or changed, is reported once (naming the file), deleted, and the run
starts from layer 0: it never loops on a damaged file and never mixes damaged tensors in.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import warnings
from collections.abc import Collection

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes
from torch import nn

from quasar_hf.atomic_folder import safetensors_header, write_bytes_atomically
from quasar_hf.nn import RotatedW8A8Linear, W8A8Linear

PROGRESS = "progress.json"
STATE_FORMAT = 3  # 2: fp32 calibration rounds activations to the model dtype; 3: per-file SHA-256


def fingerprint(parts: dict) -> str:
    """SHA-256 of a JSON description of everything the quantized result depends on."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _atomic_write(path: str, data: bytes) -> str:
    """Write `data` to `path` atomically (atomic_folder.write_bytes_atomically); its SHA-256."""
    write_bytes_atomically(path, data)
    return hashlib.sha256(data).hexdigest()


class DamagedState(ValueError):
    """A state file does not match the digest progress.json recorded for it."""


class ResumeState:
    """The state folder of one quantization run (see the module docstring)."""

    def __init__(self, folder: str, key: str) -> None:
        self.folder = folder
        self.key = key
        os.makedirs(folder, exist_ok=True)

    def progress(self, layers_path: str, layer_count: int, linear_names: Collection[str]) -> dict | None:
        """The saved progress when it belongs to this run, its fields are well-formed and name what this
        model has (`layers_path`.i, i < `layer_count`; `linear_names`, full names), and every file it names
        is whole; else None.

        A state of another run, or a damaged or edited one, is reported (a warning naming the cause and
        the file or field) and deleted, so the run starts from layer 0 and a rerun does not meet it again.
        Everything is checked before any layer is touched."""
        path = os.path.join(self.folder, PROGRESS)
        if not os.path.isfile(path):
            return None
        try:
            with open(path) as f:
                saved = json.load(f)
            if not isinstance(saved, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as error:
            return self._start_over(f"{path} cannot be read ({error})")
        if saved.get("format") != STATE_FORMAT or saved.get("fingerprint") != self.key:
            return self._start_over(
                f"{self.folder} holds the state of another run (a different model, settings or quasar_hf version)"
            )
        try:
            check_progress_fields(saved, layers_path, layer_count, linear_names)
            layer_tensors = {}
            for name in self._files_of(saved):
                layer_tensors[name] = set(_header(self._verified_bytes(saved, name))) - {"__metadata__"}
            check_prescaled_names(saved, layers_path, layer_tensors)
        except DamagedState as error:
            return self._start_over(str(error))
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
        previous = self._recorded_digests(index)
        layer_name, hidden_name = _layer_name(index), _hidden_name(index + 1)
        digests = {name: previous[name] for name in map(_layer_name, range(index)) if name in previous}
        digests[layer_name] = _atomic_write(self._path(layer_name), save_bytes(tensors, metadata={"kinds": json.dumps(kinds)}))
        stacked = {f"block_{i}": h.detach().cpu().contiguous() for i, h in enumerate(hidden)}
        digests[hidden_name] = _atomic_write(self._path(hidden_name), save_bytes(stacked))
        progress = {
            "format": STATE_FORMAT,
            "fingerprint": self.key,
            "next_layer": index + 1,
            "gathered": gathered,
            "generator": base64.b64encode(generator.get_state().numpy().tobytes()).decode(),
            "sha256": digests,
        }
        _atomic_write(self._path(PROGRESS), json.dumps(progress).encode())
        stale = self._path(_hidden_name(index))
        if os.path.exists(stale):
            os.remove(stale)

    def restore_layer(self, progress: dict, index: int, layer: nn.Module, backend: str, bias_dtype: torch.dtype) -> None:
        """Put the finished layer `index` back from the bytes its digest vouches for: W8A8 modules
        where it had them, then all its tensors."""
        data = self._verified_bytes(progress, _layer_name(index))
        kinds = json.loads(_header_metadata(data)["kinds"])
        tensors = load_bytes(data)
        for name, kind in kinds.items():
            linear = layer.get_submodule(name)
            cls = RotatedW8A8Linear if kind == "rotated" else W8A8Linear
            module = cls.shaped_like(linear, backend, has_act_prescale=f"{name}.act_prescale" in tensors, bias_dtype=bias_dtype)
            layer.set_submodule(name, module)
        layer.load_state_dict(tensors, strict=True)
        for module in layer.modules():
            if isinstance(module, W8A8Linear):
                module.prepare()

    def restore_run(self, progress: dict, generator: torch.Generator) -> list[torch.Tensor]:
        """The hidden states feeding the next layer; sets `generator` to the saved state."""
        raw = base64.b64decode(progress["generator"])
        generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        saved = load_bytes(self._verified_bytes(progress, _hidden_name(progress["next_layer"])))
        return [saved[f"block_{i}"] for i in range(len(saved))]

    def _files_of(self, progress: dict) -> list[str]:
        """The state files a resume from `progress` reads: every finished layer and the next hidden states."""
        return [*map(_layer_name, range(progress["next_layer"])), _hidden_name(progress["next_layer"])]

    def _verified_bytes(self, progress: dict, name: str) -> bytes:
        """The file's bytes, after checking them against the digest progress.json recorded."""
        expected = (progress.get("sha256") or {}).get(name)
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as error:
            raise DamagedState(f"{path} cannot be read ({error.strerror or error})") from None
        if expected is None or hashlib.sha256(data).hexdigest() != expected:
            raise DamagedState(f"{path} does not match the SHA-256 recorded in progress.json (truncated or changed)")
        return data

    def _recorded_digests(self, index: int) -> dict:
        """The digests of the state this run continues (layers before `index`), or none."""
        if index == 0:
            return {}
        with open(self._path(PROGRESS)) as f:
            return json.load(f).get("sha256", {})

    def _start_over(self, cause: str) -> None:
        warnings.warn(
            f"{cause}: not resuming. Deleted the saved state in {self.folder}; quantizing from layer 0.",
            stacklevel=3,
        )
        for entry in os.listdir(self.folder):
            if is_state_file(entry):  # only what save_layer writes: a model saved in this folder stays
                os.remove(os.path.join(self.folder, entry))
        return None

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)


STATE_FILE = re.compile(r"(\.tmp-)?((layer|hidden)_\d{4,}\.safetensors|progress\.json)(\..*\.tmp)?")  # temporaries too


def is_state_file(name: str) -> bool:
    """A file ResumeState writes (layer_NNNN, hidden_NNNN, progress.json, or a temporary of one of them)."""
    return STATE_FILE.fullmatch(name) is not None


def check_progress_fields(saved: dict, layers_path: str, layer_count: int, linear_names: Collection[str]) -> None:
    """Raise DamagedState naming the first field of progress.json with the wrong type, or naming what this
    model does not have (a hand-edited or foreign state); the file's own digests cannot vouch for it."""
    next_layer = saved.get("next_layer")
    if type(next_layer) is not int or not 1 <= next_layer <= layer_count:
        raise DamagedState(f"progress.json: next_layer must be a layer number from 1 to {layer_count}, got {next_layer!r}")
    if not isinstance(saved.get("generator"), str) or not isinstance(saved.get("sha256"), dict):
        raise DamagedState("progress.json: generator (base64 text) or sha256 (an object) has the wrong type")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in saved["sha256"].items()):
        raise DamagedState("progress.json: sha256 must map file names to hex digests")
    try:
        torch.Generator().set_state(
            torch.frombuffer(bytearray(base64.b64decode(saved["generator"], validate=True)), dtype=torch.uint8)
        )
    except (ValueError, RuntimeError):
        raise DamagedState("progress.json: generator is not a saved torch.Generator state") from None
    gathered = saved.get("gathered")
    if not isinstance(gathered, dict) or set(gathered) != {"alphas", "rotated", "prescaled"}:
        raise DamagedState("progress.json: gathered must be an object with exactly alphas, rotated and prescaled")
    alphas, rotated, prescaled = gathered["alphas"], gathered["rotated"], gathered["prescaled"]
    if not isinstance(alphas, dict) or not isinstance(rotated, list) or not isinstance(prescaled, list):
        raise DamagedState("progress.json: gathered.alphas must be an object, gathered.rotated and .prescaled lists")
    for key, alpha in alphas.items():
        index = key.partition(".")[0]
        if not index.isdigit() or int(index) >= next_layer:
            raise DamagedState(f"progress.json: alpha {key!r} names no finished layer (its name starts with the layer number)")
        if type(alpha) not in (int, float) or not 0.0 <= alpha <= 1.0:
            raise DamagedState(f"progress.json: alpha {key!r} must be a number in [0, 1], got {alpha!r}")
    finished = {f"{layers_path}.{i}." for i in range(next_layer)}
    for field, names in (("rotated", rotated), ("prescaled", prescaled)):
        for name in names:
            if not isinstance(name, str) or name not in linear_names or not any(name.startswith(p) for p in finished):
                raise DamagedState(f"progress.json: gathered.{field} names {name!r}, not a quantized linear of a finished layer")


def check_prescaled_names(saved: dict, layers_path: str, layer_tensors: dict[str, set[str]]) -> None:
    """Each prescaled name has its act_prescale in its finished layer's file."""
    for name in saved["gathered"]["prescaled"]:
        index, _, local = name[len(layers_path) + 1 :].partition(".")
        if f"{local}.act_prescale" not in layer_tensors.get(_layer_name(int(index)), set()):
            raise DamagedState(f"progress.json: gathered.prescaled names {name!r}, whose layer file holds no act_prescale")


def _layer_name(index: int) -> str:
    return f"layer_{index:04d}.safetensors"


def _hidden_name(index: int) -> str:
    return f"hidden_{index:04d}.safetensors"


def _header(data: bytes) -> dict:
    """The header of a safetensors file held in memory (its bytes were checked against their digest)."""
    return safetensors_header(data)[0]


def _header_metadata(data: bytes) -> dict:
    """The `__metadata__` of a safetensors file held in memory."""
    return _header(data).get("__metadata__", {})
