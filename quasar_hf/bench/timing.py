"""The one timing helper of the benchmarks: wall-clock seconds, synchronized on CUDA."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; CPU needs nothing)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device | str) -> tuple[Any, float]:
    """(fn(), seconds it took), the device synchronized before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def median_time(fn: Callable[[], Any], device: torch.device | str, iters: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `iters` calls, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device)[1] for _ in range(iters))
