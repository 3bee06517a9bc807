"""PreparedModule: a module whose bound kernels derive from its tensors, prepared again whenever they change."""

from __future__ import annotations

import abc

import torch
from torch import nn


class PreparedModule(nn.Module, metaclass=abc.ABCMeta):
    """Calls `prepare()` after `_apply` (`.to()`, `.cpu()`, ...), `load_state_dict`, copies and unpickling.

    `derived` names the attributes holding bound kernels (closures over raw pointers): copies and
    pickles drop them and prepare their own. What a traced forward reads (the op layouts: tuples of
    tensors and plain values) stays in the pickled state: Dynamo's guard-state pickle rebuilds the
    module tree from it, with its tensors replaced by placeholders, and then nothing is prepared.
    `fp32_buffers` names buffers that stay float32 through a dtype change (`.to(torch.float16)` moves
    them but keeps their exact values), as quantization scales must.
    """

    derived: tuple[str, ...] = ()
    fp32_buffers: tuple[str, ...] = ()

    @abc.abstractmethod
    def prepare(self) -> None:
        """Validate, pack and bind from the module's current tensors (each subclass says how)."""

    def _apply(self, fn, recurse: bool = True):
        kept = {name: getattr(self, name) for name in self.fp32_buffers if getattr(self, name, None) is not None}
        module = super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != torch.float32:  # a dtype change: the original values, on the new device
                self._buffers[name] = before.to(device=after.device)
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
        tensors = [*self._parameters.values(), *self._buffers.values()]
        if all(isinstance(t, torch.Tensor) and t.device.type != "meta" for t in tensors if t is not None):
            self.prepare()  # real tensors: pack again (placeholders or meta tensors: keep the state as pickled)
