"""torch.nn.Module surgery that reaches its private child table (`_modules`): a shallow copy of a module
that shares its parameters and children but not the table itself."""

from __future__ import annotations

import copy

from torch import nn


def shallow_module_copy(module: nn.Module, replace: dict[str, nn.Module] | None = None) -> nn.Module:
    """A copy of `module` sharing every parameter and child, with its own child table (`replace` swaps children).

    Attribute changes on the copy (e.g. a decoder layer's attention `layer_idx`) leave the original alone.
    """
    new = copy.copy(module)
    new._modules = dict(module._modules)
    for name, child in (replace or {}).items():
        new._modules[name] = child
    return new
