"""Calibration on a compute device other than the layers' home: no op may mix devices.

A machine with a GPU calibrates CPU-resident layers on the GPU (placement.py). The CPU suite has one
real device, so the second one here is `meta` (tensors without data, on every machine): layers live
on the CPU and compute on meta, under a dispatch mode that fails any op whose tensor arguments lie on
two devices, as CUDA does. Meta tensors hold no values, so the mode answers their data-dependent
reads (`.item()`, copies back to the CPU) with zeros: this run checks placement, not numbers; the
numbers of the same code on one device are the rest of the suite's.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from quasar_hf import QuasarConfig
from quasar_hf.hf.quantize_on_load import find_quantizable_linears
from quasar_hf.hf.sequential import quantize_layers_sequentially
from quasar_hf.nn import W8A8Linear
from quasar_hf.smoothquant.mappings import resolve_mappings
from quasar_hf.smoothquant.placement import compute_device_for, place_layers, validate_calibration_device
from tests.helpers.tiny_models import tiny_model

aten = torch.ops.aten
_COPIES = {aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}  # the moves between devices
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default, aten._int_mm.default}


class OneDevicePerOp(TorchDispatchMode):
    """Raise on an op whose tensor arguments lie on two devices (a CPU 0-dim tensor is a scalar, which CUDA
    accepts beside its own tensors); give meta tensors' data-dependent reads a value so the run goes on."""

    def __init__(self) -> None:
        super().__init__()
        self.matmuls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1 and func not in _COPIES:
            shapes = [(tuple(t.shape), str(t.device)) for t in tensors]
            raise AssertionError(f"{func} mixes devices {sorted(devices)}: {shapes}")
        if func in _MATMULS:
            self.matmuls[tensors[0].device.type] += 1
        meta_source = bool(tensors) and tensors[-1 if func in _COPIES else 0].device.type == "meta"
        if func is aten._local_scalar_dense.default and meta_source:
            return True if args[0].dtype == torch.bool else 0  # "all finite" checks pass
        if func is aten._to_copy.default and meta_source and kwargs.get("device", torch.device("meta")).type != "meta":
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=kwargs["device"])
        if func in _COPIES and meta_source and args[0].device.type != "meta":
            return args[0]
        return func(*args, **kwargs)


def _blocks() -> torch.Tensor:
    return torch.randint(0, 96, (3, 24), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize(
    "settings",
    [
        dict(),  # the defaults: alpha search per linear, GPTQ rounding, down_proj rotated
        dict(alpha="auto", alpha_search="layer", weight_rounding="nearest", rotate=[]),
        dict(alpha=0.5, keep_float=["model.layers.1.mlp.down_proj"]),
    ],
    ids=["defaults", "layer_search", "keep_float"],
)
def test_calibration_on_a_second_device_never_mixes_devices(settings: dict) -> None:
    model = tiny_model("llama", layers=2)
    config = QuasarConfig(backend="reference", **settings)
    arch = resolve_mappings(model)
    names = find_quantizable_linears(model, arch.layers_path, config.modules_to_not_convert)
    mode = OneDevicePerOp()
    with mode:
        quantize_layers_sequentially(model, arch, names, _blocks(), config, progress=False, device="meta")
    assert mode.matmuls["meta"] > mode.matmuls["cpu"]  # the layers' work ran on the compute device
    for name, tensor in model.state_dict().items():
        assert tensor.device.type == "cpu", f"{name} did not come home"
    assert sum(isinstance(m, W8A8Linear) for m in model.modules()) >= len(names) - 1


def test_compute_device_choice() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 1)
    assert compute_device_for("cpu", gpu) == cpu  # told to stay on the CPU: it does
    assert compute_device_for("auto", gpu) == gpu  # a GPU layer computes where it lives
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else cpu
    assert compute_device_for("auto", cpu) == expected
    assert compute_device_for("meta", cpu) == torch.device("meta")
    with pytest.raises(ValueError, match="calibration_device"):
        validate_calibration_device("gpu0")
    with pytest.raises(ValueError, match="calibration_device"):
        QuasarConfig(calibration_device="meta")
    assert QuasarConfig(calibration_device="cuda:1").calibration_device == "cuda:1"
    assert "calibration_device" not in QuasarConfig().to_dict()  # a run-time choice, not a property of the weights


def test_split_layer_is_refused_by_name() -> None:
    model = tiny_model("llama")
    model.model.layers[1].mlp.to("meta")
    with pytest.raises(ValueError, match="decoder layer 1"):
        place_layers(model.model.layers)
