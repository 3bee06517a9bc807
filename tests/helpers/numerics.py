"""Comparing generated tokens and bf16 values."""

from __future__ import annotations

import math

import torch


def bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x != 0 else 2.0**-133


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    n = min(a.shape[0], b.shape[0])
    diff = (a[:n] != b[:n]).nonzero()
    if diff.numel():
        return int(diff[0])
    return None if a.shape[0] == b.shape[0] else n
