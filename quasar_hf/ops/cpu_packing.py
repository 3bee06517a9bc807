"""The fused CPU W8A8 kernel's weight layout (csrc/w8a8_vnni.c, csrc/w8a8_avx2.c): packing a weight
once, and unpacking it (the packed ops' plain-PyTorch fallback).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedWeight:
    """int8 weight in the kernel's layout; opaque to callers, who cache it next to the weight.

    data: int8 [Np/16, Kp/4, 16, 4] (N padded to 16, K to 4, zeros); wsum128: int32 [Np],
    128 * sum_k W[n, k] (wrapping like the reference's int32 cast).
    """

    data: torch.Tensor
    wsum128: torch.Tensor
    out_features: int
    in_features: int


def pack_weight(weight_q: torch.Tensor) -> PackedWeight:
    """int8 [N, K] -> PackedWeight. Re-pack whenever the weight changes."""
    if not isinstance(weight_q, torch.Tensor) or weight_q.dtype != torch.int8 or weight_q.dim() != 2:
        raise TypeError(
            "pack_weight expects an int8 tensor [out_features, in_features]; "
            f"got {getattr(weight_q, 'dtype', type(weight_q))} {tuple(getattr(weight_q, 'shape', ()))}"
        )
    if weight_q.device.type != "cpu":
        raise ValueError(f"pack_weight needs a CPU weight, got device {weight_q.device}; move it with .cpu()")
    n, k = weight_q.shape
    n_pad, k_pad = -n % 16, -k % 4
    w = torch.nn.functional.pad(weight_q.detach(), (0, k_pad, 0, n_pad))  # [Np, Kp]
    data = w.reshape(w.shape[0] // 16, 16, w.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
    wsum128 = (w.long().sum(dim=1) * 128).to(torch.int32)  # [Np]
    return PackedWeight(data, wsum128, n, k)


def unpack_weight(data: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The int8 weight [N, K] that `pack_weight` laid out as `data` (the packed op's fallback)."""
    blocks, quads = data.shape[0], data.shape[1]
    return data.permute(0, 2, 1, 3).reshape(blocks * 16, quads * 4)[:out_features, :in_features]
