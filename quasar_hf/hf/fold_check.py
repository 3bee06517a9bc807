"""Check the rule fusion rests on, by tracing one forward: a fold group's norm output goes to its projections
and to nothing else.

Fusing a group (hf/fusion.py) puts a module returning the stacked projections where the norm was, and
a column slice where each projection was. That computes the same values only if the decoder layer's
forward passes the norm's output to those projections and uses it for nothing else: a MoE router, a
residual add or a gate that also read it would get projections instead of normed hidden states.

`groups_breaking_the_rule(model, groups)` runs the unfused model once on two tokens under a
TorchFunctionMode that watches every output of decoder layer 0's group norms (the forward stops after
that layer): any torch function that
takes one of them outside the group's own projections, other than reading its shape, dtype or device,
breaks the rule for that group. It runs once per model, when the model is first fused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from quasar_hf import compat
from quasar_hf.architectures import FoldGroup

METADATA = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "size", "dim"}


class _WatchNormOutputs(TorchFunctionMode):
    """Records, per group, the first torch function that takes a watched tensor outside that group's projections."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: dict[int, str] = {}  # id(tensor) -> the group's norm path
        self.kept: list[torch.Tensor] = []  # alive for the whole trace, so ids stay unique
        self.inside = 0  # > 0 while a group projection runs (its own use of the tensor is the rule)
        self.uses: dict[str, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside == 0 and _name(func) not in METADATA:
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor) and id(value) in self.watched:
                    self.uses.setdefault(self.watched[id(value)], _name(func))
        return func(*args, **kwargs)


class _LayerDone(Exception):
    """Raised after decoder layer 0's forward: the rest of the model need not run."""


def _stop(*args) -> None:
    raise _LayerDone


def _name(func) -> str:
    """A torch function's name; a property getter's is its property's (Tensor.shape -> "shape")."""
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and owner is not None:
        return getattr(owner, "__name__", "__get__")
    return getattr(func, "__name__", str(func))


def groups_breaking_the_rule(model: nn.Module, layer: nn.Module, groups: Sequence[FoldGroup]) -> dict[str, str]:
    """{norm path: why} for each group of `layer` (decoder layer 0, unfused) whose norm output is used beyond its
    projections. Traced once per model (kept on the instance: fusing it again, as projections_apart does,
    reuses the answer)."""
    checked = model.__dict__.setdefault(CHECKED_ATTR, {})
    key = tuple(groups)
    if key not in checked:
        checked[key] = _check(model, layer, groups)
    return dict(checked[key])


CHECKED_ATTR = "_quasar_fold_check"  # on the model instance: {groups: ((norm, why), ...)}


def _check(model: nn.Module, layer: nn.Module, groups: Sequence[FoldGroup]) -> tuple[tuple[str, str], ...]:
    mode = _WatchNormOutputs()
    handles = []
    try:
        for group in groups:
            try:
                norm = layer.get_submodule(group.norm)
                projections = [layer.get_submodule(path) for path in group.projections]
            except AttributeError:
                continue  # a layer shaped unlike the spec: fusion leaves it alone anyway

            def record(module, args, output, norm_path=group.norm):
                mode.watched[id(output)] = norm_path
                mode.kept.append(output)

            handles.append(norm.register_forward_hook(record))
            for projection in projections:
                handles.append(projection.register_forward_pre_hook(lambda *_: setattr(mode, "inside", mode.inside + 1)))
                handles.append(projection.register_forward_hook(lambda *_: setattr(mode, "inside", mode.inside - 1)))
        handles.append(layer.register_forward_hook(_stop))  # layer 0 is all the check needs
        ids = torch.tensor([[0, 1]], device=compat.input_device(model))
        with torch.no_grad(), mode:
            model(input_ids=ids, use_cache=False)
    except _LayerDone:
        pass
    except Exception as error:  # the rule cannot be shown: no group is fused
        reason = f"the fusion check could not run this model ({type(error).__name__}: {error})"
        return tuple((group.norm, reason) for group in groups)
    finally:
        for handle in handles:
            handle.remove()
    return tuple(
        (norm, f"{type(model).__name__}'s decoder layer also passes {norm}'s output to {use}, not only to its projections")
        for norm, use in mode.uses.items()
    )
