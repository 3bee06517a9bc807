"""keep_float: keep the few decoder linears that W8A8 damages most in the model's float dtype.

During quantization each candidate linear is measured on the calibration rows quantization
already sampled (W8A8 vs float output error, `linear_error.calibration_error`). With
`keep_float="auto"` the most damaging ones are kept, in order of error, until the next would
exceed the byte budget: the bytes a verify step reads in addition, `float bytes - int8 bytes`
of the kept linears, at most `budget` times the int8 weight bytes of all candidates. A list of
names keeps exactly those. A kept linear holds its *smoothed* float weight (the preceding norm
or linear was already folded), with any activation pre-scale folded into its columns, so the
model's float function is unchanged.

Usage by a quantization flow (layer by layer or all at once):
    selector = KeepFloatSelector(config.keep_float, config.keep_float_budget, model, candidate_names)
    selector.offer(name, samples, original_weight, smoothed_weight, bias, prescale)  # before the W8A8 swap
    ...
    kept = selector.apply(model)   # after all swaps: chosen W8A8Linears become nn.Linear again
    config.keep_float_info = selector.info()
"""

from __future__ import annotations

import torch
from torch import nn

from quasar_hf.ops.hadamard import HadamardRotation
from quasar_hf.smoothquant.linear_error import calibration_error


def int8_bytes(weight: torch.Tensor) -> int:
    """Bytes a W8A8 linear reads for this weight [N, K]: int8 values + fp32 row scales."""
    return weight.shape[0] * weight.shape[1] + 4 * weight.shape[0]


def float_bytes(weight: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes the same weight [N, K] reads when kept in `dtype`."""
    return weight.shape[0] * weight.shape[1] * torch.empty((), dtype=dtype).element_size()


def choose_keep_float(errors: dict[str, float], added_bytes: dict[str, int], int8_total: int, budget: float) -> list[str]:
    """The most damaging names (largest `errors`, ties by name) while their `added_bytes` sum stays
    within `budget * int8_total`; stops at the first that does not fit, so a larger candidate set
    never selects a name a smaller one rejected (the choice can be made while layers stream by)."""
    limit = budget * int8_total
    chosen, spent = [], 0
    for name in sorted(errors, key=lambda n: (-errors[n], n)):
        if spent + added_bytes[name] > limit:
            break
        chosen.append(name)
        spent += added_bytes[name]
    return chosen


class KeepFloatSelector:
    """Measures candidates as quantization offers them and keeps the float weights of the chosen ones.

    Memory: only the currently chosen float weights are held (bounded by the budget for "auto"); a
    linear once left out is never chosen later (see `choose_keep_float`), so its copy can go at once.
    """

    def __init__(self, keep_float: str | list[str], budget: float, model: nn.Module, candidates: list[str]) -> None:
        self.mode = "auto" if keep_float == "auto" else "list"
        self.budget = float(budget)
        self.candidates = set(candidates)
        self.added: dict[str, int] = {}
        self.int8_total = 0
        for name in candidates:  # the budget's base is known before any layer is quantized
            weight = model.get_submodule(name).weight
            self.int8_total += int8_bytes(weight)
            self.added[name] = float_bytes(weight, weight.dtype) - int8_bytes(weight)
        if self.mode == "list":
            unknown = sorted(set(keep_float) - self.candidates)
            if unknown:
                raise ValueError(
                    f"keep_float names {unknown} are not decoder linears that would be quantized; choose from "
                    f"names like {sorted(self.candidates)[:3]} (full module names, see config.quantized_modules)"
                )
            self.requested = set(keep_float)
        self.errors: dict[str, dict] = {}
        self._weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.chosen: list[str] = []

    @torch.no_grad()
    def offer(
        self,
        name: str,
        samples: torch.Tensor,
        original_weight: torch.Tensor,
        smoothed_weight: torch.Tensor,
        bias: torch.Tensor | None,
        prescale: torch.Tensor | None,
        rotation: HadamardRotation | None = None,
        home: torch.device | None = None,
    ) -> None:
        """One candidate before its W8A8 swap: samples [S, K] original inputs, weights [N, K], bias [N]
        (smoothed, as deployed), prescale [K] or None, rotation: its input's Hadamard rotation when it
        becomes a RotatedW8A8Linear (measured as such; a kept float copy computes unrotated). The float
        copy is kept in the original dtype, on `home` (the layer's device after its turn; default: the weight's)."""
        if name not in self.candidates:
            return
        dtype = original_weight.dtype
        if self.mode == "list" and name not in self.requested:
            return
        self.errors[name] = calibration_error(samples, original_weight, smoothed_weight, bias, rotation)
        if self.mode == "list":
            chosen = sorted(self.requested & set(self.errors))
        else:
            # every measured error stays: a linear that no longer fits still stops the worst-first walk
            both = {n: e["both_rel_mse"] for n, e in self.errors.items()}
            chosen = choose_keep_float(both, self.added, self.int8_total, self.budget)
        if name in chosen:
            weight = smoothed_weight.float() * (prescale.float() if prescale is not None else 1.0)  # x*p @ W.T
            home = weight.device if home is None else home
            self._weights[name] = (weight.to(home, dtype), None if bias is None else bias.detach().to(home, copy=True))
        self._weights = {n: w for n, w in self._weights.items() if n in chosen}
        self.chosen = chosen

    def apply(self, model: nn.Module) -> list[str]:
        """Replace each chosen (already swapped) module by an nn.Linear holding its smoothed float weight."""
        missing = sorted(set(self.chosen) - set(self._weights))
        if missing:
            raise RuntimeError(f"keep_float chose {missing} but never received their float weights")
        for name in self.chosen:
            weight, bias = self._weights[name]
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
            linear.weight.data.copy_(weight)
            if bias is not None:
                linear.bias.data.copy_(bias.to(weight.dtype))
            model.set_submodule(name, linear)
        self._weights = {}
        return sorted(self.chosen)

    def info(self) -> dict:
        """What goes into config.json: the kept names, their measured errors and the price in bytes."""
        added = sum(self.added[n] for n in self.chosen)
        rest = sorted((n for n in self.errors if n not in self.chosen), key=lambda n: -self.errors[n]["both_rel_mse"])
        return {
            "mode": self.mode,
            "budget": self.budget,
            "modules": sorted(self.chosen),
            "calibration_error": {
                n: {"sqnr_db": round(self.errors[n]["both_sqnr_db"], 3), "rel_mse": float(self.errors[n]["both_rel_mse"])}
                for n in sorted(self.chosen)
            },
            "worst_not_kept": None
            if not rest
            else {
                "module": rest[0],
                "sqnr_db": round(self.errors[rest[0]]["both_sqnr_db"], 3),
                "added_bytes": self.added[rest[0]],
            },
            "added_bytes": int(added),
            "int8_weight_bytes": int(self.int8_total),
            "added_fraction": round(added / max(1, self.int8_total), 5),
        }
