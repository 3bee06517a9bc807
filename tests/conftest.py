"""Test-session settings.

Without CUDA, Triton kernels are tested in Triton's CPU interpreter. Triton reads
TRITON_INTERPRET when it is first imported, so it is set here, before any test imports it.

`@pytest.mark.kernels("w8a8", ...)` marks a test that needs those C kernels (names of
`quasar_hf.ops.native.kernel_titles()`; none given: the C++ library): `tests.helpers.kernels` skips it
where they are missing, or fails it under QUASAR_HF_REQUIRE_KERNELS=1 when they did not build.
`@pytest.mark.cuda` marks a GPU regression check: skipped where torch sees no CUDA device
(`pytest -m cuda` runs them alone: benchmarks/gpu/gpu_check.sh).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_setup(item: pytest.Item) -> None:
    from tests.helpers.kernels import apply_kernel_markers  # imported late: after TRITON_INTERPRET is set

    apply_kernel_markers(item)
    if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
