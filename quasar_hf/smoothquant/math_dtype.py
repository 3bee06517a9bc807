"""The dtype calibration computes in, and casting one decoder layer to it and back.

On a CPU without native bf16 (no AVX512-BF16 or AMX: AMD Zen 3, most laptops) torch emulates bf16
GEMMs: a 512 x 1536 by 1536 x 1536 bf16 matmul ran at 0.6 GFLOPS on a Zen 3, fp32 at about 50
(shared/NOTES.md). Calibration forwards, the alpha search and GPTQ's Hessians are such GEMMs, so
there they run in fp32, whatever dtype the model was loaded in; fp16 likewise. The quantized
checkpoint keeps the model's dtype: after its turn each layer's float tensors go back to it
(bf16 values are exact in fp32, so nothing is lost on the way in).

The choice comes from the CPU's flags (deterministic: a rerun or a resumed run makes the same
choice), is recorded in `calibration_info`, and `QuasarConfig(calibration_dtype=...)` overrides it.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch
from torch import nn

CALIBRATION_DTYPES = ("auto", "model", "float32")
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 (Linux /proc/cpuinfo names)


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux x86 `flags`, arm64 `Features`); empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    flags = cpu_flags()
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "bf16" in flags
    return any(flag in flags for flag in _NATIVE_BF16_FLAGS)


def calibration_dtype(model_dtype: torch.dtype, device: torch.device, requested: str = "auto") -> tuple[torch.dtype, str]:
    """(dtype to calibrate in, why) for a model of `model_dtype` calibrated on `device`."""
    if requested not in CALIBRATION_DTYPES:
        raise ValueError(f"calibration_dtype must be one of {CALIBRATION_DTYPES}; got {requested!r}")
    if requested == "model" or model_dtype == torch.float32:
        return model_dtype, "the model's dtype" + (" (requested)" if requested == "model" else "")
    if requested == "float32":
        return torch.float32, "requested"
    if torch.device(device).type != "cpu":
        return model_dtype, f"the model's dtype ({torch.device(device).type} computes it natively)"
    if model_dtype == torch.bfloat16 and cpu_has_native_bf16():
        return model_dtype, "the model's dtype (this CPU has native bf16)"
    name = str(model_dtype).replace("torch.", "")
    return torch.float32, f"this CPU emulates {name} matrix products (no native {name} flag)"


def float_tensors(layer: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """(module, name, is_parameter) of every floating-point parameter and buffer under `layer`."""
    found = []
    for module in layer.modules():
        found += [(module, n, True) for n, t in module.named_parameters(recurse=False) if t.is_floating_point()]
        found += [(module, n, False) for n, t in module.named_buffers(recurse=False) if t.is_floating_point()]
    return found


def cast_layer(layer: nn.Module, dtype: torch.dtype) -> list[tuple]:
    """Cast the layer's floating tensors to `dtype` in place (parameters keep their objects, with new
    data); returns what `restore_dtypes` needs to give each its old dtype back."""
    restore = []
    for module, name, is_parameter in float_tensors(layer):
        tensor = getattr(module, name)
        if tensor.dtype == dtype:
            continue
        if is_parameter:
            restore.append((tensor, tensor.dtype, None, name))
            tensor.data = tensor.data.to(dtype)
        else:
            setattr(module, name, tensor.to(dtype))
            restore.append((getattr(module, name), tensor.dtype, module, name))
    return restore


def restore_dtypes(restore: list[tuple]) -> None:
    """Undo `cast_layer`: parameters (wherever they live now, e.g. a kept-float copy) and buffers
    their module still holds."""
    for tensor, dtype, module, name in restore:
        if module is None:
            tensor.data = tensor.data.to(dtype)
        elif getattr(module, name, None) is tensor:
            setattr(module, name, tensor.to(dtype))


def cast_floats(obj, dtype: torch.dtype):
    """Floating tensors inside tuples/lists/dicts cast to `dtype`; everything else as is."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def _round_floats(obj, dtype: torch.dtype):
    """Floating tensors inside tuples/lists rounded to `dtype`'s values, kept in their own dtype."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype).to(obj.dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_round_floats(o, dtype) for o in obj)
    return obj


@contextmanager
def activations_rounded_to(layer: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """While open, every module under `layer` (the layer included) sees its floating inputs and
    passes on its floating outputs rounded to `dtype`'s values: the activations a model running in
    `dtype` has, so statistics, Hessians and searched alphas computed in fp32 describe the deployed
    (e.g. bf16) activations, not fp32 ones it never sees. Inputs cover what modules' forwards compute
    between modules (attention's output, act(gate) * up). A tensor read by several modules (q/k/v) is
    rounded once and they all get the same rounded tensor. Modules swapped in while open are not hooked."""
    last: dict = {}

    def rounded_once(x):
        if not isinstance(x, torch.Tensor):
            return _round_floats(x, dtype)
        if last.get("x") is not x or last.get("version") != x._version:  # holding x: its id cannot be reused
            last.update(x=x, version=x._version, rounded=_round_floats(x, dtype))
        return last["rounded"]

    handles = []
    try:
        for module in layer.modules():
            handles.append(module.register_forward_pre_hook(lambda _m, args: tuple(rounded_once(a) for a in args)))
            handles.append(module.register_forward_hook(lambda _m, _a, out: _round_floats(out, dtype)))
        yield
    finally:
        for handle in handles:
            handle.remove()
