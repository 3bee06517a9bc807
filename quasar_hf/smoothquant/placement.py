"""Where layer-by-layer calibration computes, and moving what each phase reads there.

This is the one place that decides devices during quantization. Each decoder layer has a *home*
(where the loaded model keeps it, and where it goes back after its turn) and a *compute* device
(where its statistics forward, alpha search, GPTQ rounding and W8A8 swap run). With
`QuasarConfig(calibration_device="auto")` a layer on a GPU computes on that GPU and a layer on the
CPU computes on the current CUDA device when torch sees one, else on the CPU; "cpu" keeps every
phase on the CPU; any other torch device string ("cuda:1") names the compute device. Device memory
stays bounded by one layer's working set plus the calibration hidden states.

Everything a phase reads goes to the layer's compute device through `to_compute` and
`stats_to_compute` here, so no phase mixes devices: the captured hidden states and call arguments
(masks, rotary embeddings), the recorded statistics (abs-max and sampled rows are kept on the CPU
while recording; Hessians are summed where the inputs are). What the run keeps after a layer's
turn (its prescales, kept float weights) comes back home with `to_home`.

A layer that accelerate offloaded (device_map "cpu" beside a GPU, or "disk": its weights on the meta
device, held by its hook) is materialized for its turn and stays resident on the CPU afterwards,
dispatched there by a plain accelerate hook (compat/accelerate_hooks.py owns those names): the W8A8 layer is half the
bytes of the float one it replaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quasar_hf import compat

AUTO = "auto"


def validate_calibration_device(value: Any) -> str:
    """`value` as a device string QuasarConfig keeps ("auto", "cpu", "cuda", "cuda:1", ...), or a clear error."""
    if isinstance(value, torch.device):
        value = str(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"calibration_device must be 'auto', 'cpu' or a torch device string like 'cuda:0'; got {value!r}")
    if value == AUTO:
        return value
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"calibration_device {value!r} is not a torch device: use 'auto' (a GPU when torch sees one), "
            "'cpu', or a device string like 'cuda:0'"
        ) from None
    if device.type == "meta":
        raise ValueError("calibration_device='meta' holds no data: use 'auto', 'cpu' or a GPU like 'cuda:0'")
    return value


def check_calibration_device_here(value: str | torch.device) -> None:
    """Before quantizing: the calibration device exists on this machine (a saved config may name a GPU
    another machine had, so QuasarConfig itself does not check this)."""
    if str(value) == AUTO:
        return
    device = torch.device(value)
    if device.type == "cpu" and device.index is not None:
        raise ValueError(f"calibration_device={str(value)!r}: the CPU takes no index; use calibration_device='cpu'")
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    available = backend is not None and getattr(backend, "is_available", lambda: False)()
    count = getattr(backend, "device_count", lambda: 1)() if available else 0
    if count == 0:
        raise ValueError(
            f"calibration_device={str(value)!r}, but torch {torch.__version__} sees no {device.type} device on this "
            "machine; use calibration_device='auto' (a GPU when there is one) or 'cpu'"
        )
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"calibration_device={str(value)!r}, but torch sees {count} {device.type} device(s) here "
            f"({device.type}:0 to {device.type}:{count - 1}); use one of those, 'auto' or 'cpu'"
        )


def compute_device_for(requested: str | torch.device, home: torch.device) -> torch.device:
    """Where a layer living on `home` is calibrated (see the module docstring)."""
    if str(requested) != AUTO:
        device = torch.device(requested)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if home.type != "cpu":
        return home
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return home


def to_compute(obj: Any, device: torch.device) -> Any:
    """Tensors inside tuples, lists and dicts moved to `device`; everything else as it is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_compute(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_compute(v, device) for k, v in obj.items()}
    return obj


def stats_to_compute(stats: Any, device: torch.device) -> None:
    """A recording's statistics (CalibrationStats) moved in place to the device that smooths and rounds with them."""
    for entry in stats.by_module.values():
        entry.absmax = entry.absmax.to(device)
        entry.samples = entry.samples.to(device)
        if entry.hessian is not None:
            entry.hessian = entry.hessian.to(device)


@dataclass
class LayerPlacement:
    """One decoder layer's home and compute device, and how to move it between them."""

    index: int
    home: torch.device
    compute: torch.device
    hooked: bool = False  # accelerate dispatches it (device_map): dispatched again, resident, after its turn
    skip_keys: Any = None  # the inputs its accelerate hooks leave where they are (the KV cache), kept as they were

    def enter(self, layer: nn.Module) -> None:
        """Put the layer on its compute device, its weights resident and no accelerate hook moving them."""
        if compat.has_accelerate_hook(layer):
            compat.detach_accelerate_hook(layer, self.compute)  # offloaded weights are materialized here
        layer.to(self.compute)

    def leave(self, layer: nn.Module) -> None:
        """Back home; a layer that accelerate dispatched is dispatched again, resident on its home."""
        layer.to(self.home)
        if self.hooked:
            compat.dispatch_resident(layer, self.home, self.skip_keys)

    def to_home(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.home)


def place_layers(layers: nn.ModuleList, requested: str | torch.device = AUTO) -> list[LayerPlacement]:
    """Each decoder layer's placement; refuses a layer split across devices or on the meta device without
    an accelerate hook holding its weights."""
    placements = []
    for index, layer in enumerate(layers):
        tensors = list(layer.parameters()) + list(layer.buffers())
        devices = {t.device for t in tensors}
        hooked = compat.has_accelerate_hook(layer)
        offloaded = any(d.type == "meta" for d in devices)
        if offloaded and not compat.accelerate_holds_weights(layer):
            raise ValueError(
                f"decoder layer {index} has weights on the meta device and nothing holds their values; "
                "Quasar quantization needs every decoder layer's weights: load the model with its weights "
                "(device_map placement and offload are fine, a meta-device skeleton is not)"
            )
        if offloaded:
            home = torch.device("cpu")
        elif len(devices) != 1:
            raise ValueError(
                f"decoder layer {index} is split across devices {sorted(map(str, devices))}; keep each layer on one device"
            )
        else:
            home = devices.pop()
        skip = compat.accelerate_skip_keys(layer)
        placements.append(LayerPlacement(index, home, compute_device_for(requested, home), hooked, skip))
    return placements
