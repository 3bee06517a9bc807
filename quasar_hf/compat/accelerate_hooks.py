"""Accelerate's dispatch and offload hooks, read and moved: whether a module carries a hook (`_hf_hook`),
the hooks holding offloaded weights, materializing those weights and dropping the hooks, dispatching a
resident module, moving a hook to a replacement module, and reading offloaded tensors (Transformers'
`load_offloaded_parameter`).

Accelerate keeps its hook on a private attribute and its AlignDevicesHook fields change between
releases; the placement and save code call these functions instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def has_accelerate_hook(module: nn.Module) -> bool:
    """True when accelerate dispatches this module (device_map offload hooks move its weights itself)."""
    return hasattr(module, "_hf_hook")


def _align_hooks(module: nn.Module) -> list[Any]:
    """The AlignDevicesHooks accelerate attached to `module` itself (inside a SequentialHook too)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = list(getattr(hook, "hooks", [hook])) if hook is not None else []
    return [h for h in hooks if hasattr(h, "execution_device")]


def _offloading_hooks(module: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(submodule, hook) for every accelerate hook under `module` that holds offloaded weights."""
    return [
        (sub, hook)
        for sub in module.modules()
        for hook in _align_hooks(sub)
        if getattr(hook, "offload", False) and getattr(hook, "weights_map", None) is not None
    ]


def input_device(model: nn.Module) -> torch.device:
    """Where to put a model's input ids: the device of its first resident parameter (an offloaded one is on
    the meta device; accelerate's hooks move inputs on to each module's execution device)."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def state_dict_values(model: nn.Module, state_dict: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of `state_dict` (default: the model's), an offloaded one (on the meta
    device, its value held by an accelerate hook in memory or on disk) read from its hook, one at a time:
    what a save writes for it (Transformers' `load_offloaded_parameter`)."""
    from transformers.integrations.accelerate import load_offloaded_parameter

    for name, tensor in (model.state_dict() if state_dict is None else state_dict).items():
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
            try:
                tensor = load_offloaded_parameter(model, name)
            except (ValueError, KeyError, AttributeError):
                raise ValueError(
                    f"{name} is on the meta device and no accelerate hook holds its value; load the model with its "
                    "weights (device_map placement and offload are fine, a meta-device skeleton is not)"
                ) from None
        yield name, tensor


def accelerate_holds_weights(module: nn.Module) -> bool:
    """True when accelerate hooks under `module` hold the values of its offloaded (meta) weights."""
    return bool(_offloading_hooks(module))


def detach_accelerate_hook(module: nn.Module, device: torch.device) -> None:
    """Remove the accelerate hooks under `module`, first giving every weight they held offloaded (on the
    meta device) its value on `device`: the module then runs like any resident module."""
    from accelerate.hooks import remove_hook_from_module
    from accelerate.utils import named_module_tensors, set_module_tensor_to_device

    for sub, hook in _offloading_hooks(module):
        tensors = named_module_tensors(sub, include_buffers=hook.offload_buffers, recurse=hook.place_submodules)
        for name, tensor in list(tensors):
            if tensor.device.type == "meta":
                set_module_tensor_to_device(sub, name, device, value=hook.weights_map[name])
    remove_hook_from_module(module, recurse=True)


def dispatch_resident(module: nn.Module, device: torch.device, skip_keys: Any = None) -> None:
    """Attach an accelerate hook that runs `module`, resident on `device`, there: its inputs are moved to
    `device` (except `skip_keys`, e.g. the KV cache), as a device_map's dispatch does for resident layers."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    add_hook_to_module(module, AlignDevicesHook(execution_device=device, io_same_device=False, skip_keys=skip_keys))


def accelerate_skip_keys(module: nn.Module) -> Any:
    """The inputs accelerate's hooks on `module` leave where they are (None without hooks)."""
    hooks = _align_hooks(module)
    return hooks[0].skip_keys if hooks else None


def move_accelerate_hook(old: nn.Module, new: nn.Module) -> bool:
    """Attach `old`'s accelerate hook to `new`, a replacement holding the same resident Parameters.
    False (nothing done) when `old` has no hook or its weights are offloaded (on the meta device)."""
    if not has_accelerate_hook(old) or any(p.device.type == "meta" for p in old.parameters()):
        return False
    from accelerate.hooks import add_hook_to_module

    add_hook_to_module(new, old._hf_hook)
    return True
