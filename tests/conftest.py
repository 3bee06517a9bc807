"""Test-session settings.

Without CUDA, Triton kernels are tested in Triton's CPU interpreter. Triton reads
TRITON_INTERPRET when it is first imported, so it is set here, before any test imports it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
