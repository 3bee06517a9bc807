"""What the Triton kernels read from their environment and device: whether they run in Triton's CPU
interpreter (`TRITON_INTERPRET=1`, the tests), and how many SMs the GPU has (decode launches aim at a
few programs per SM)."""

from __future__ import annotations

import functools
import os

import torch

PROGRAMS_PER_SM = 2  # decode launches split K until about this many programs run per SM


def interpret_mode() -> bool:
    """True when Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def sm_count(device_index: int) -> int:
    """The streaming multiprocessors of CUDA device `device_index` (read once per device)."""
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def device_sm_count(device: torch.device) -> int:
    """`sm_count` of the CUDA device a tensor lives on (the current one when it has no index)."""
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())
