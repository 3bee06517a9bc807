"""PreparedModule: a module whose bound kernels derive from its tensors, prepared again whenever they change."""

from __future__ import annotations

import abc

from torch import nn


class PreparedModule(nn.Module, metaclass=abc.ABCMeta):
    """Calls `prepare()` after `_apply` (`.to()`, `.cpu()`, ...), `load_state_dict`, copies and unpickling.

    `derived` names the attributes holding bound kernels (closures over raw pointers): copies and
    pickles drop them and prepare their own.
    """

    derived: tuple[str, ...] = ()

    @abc.abstractmethod
    def prepare(self) -> None:
        """Validate, pack and bind from the module's current tensors (each subclass says how)."""

    def _apply(self, fn, recurse: bool = True):
        module = super()._apply(fn, recurse)
        self.prepare()
        return module

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.prepare()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update(dict.fromkeys(self.derived))
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.prepare()
