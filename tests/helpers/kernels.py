"""Skip or fail a test that needs a C kernel: the one place that decides.

A kernel can be missing for two kinds of reason. The CPU lacks the instructions every build of it
needs (AVX512-BF16 for the prompt kernel, say): the test skips, everywhere. Or the library did not
build, load, or pass its smoke test (no g++, a compiler error): the test skips naming the cause,
unless `QUASAR_HF_REQUIRE_KERNELS=1` (CI sets it), where that is a failure, so a run that tested
only the fallbacks is never green.
"""

from __future__ import annotations

import os

import pytest

from quasar_hf.ops import native

REQUIRE_KERNELS_ENV = "QUASAR_HF_REQUIRE_KERNELS"


def kernels_required() -> bool:
    """True when `$QUASAR_HF_REQUIRE_KERNELS` is 1: a kernel that does not build or load fails its tests."""
    return os.environ.get(REQUIRE_KERNELS_ENV, "") == "1"


def missing_kernel_reason(kernel: str | None = None) -> tuple[str | None, bool]:
    """(why `kernel` cannot run here or None, whether that is a build or load failure rather than a CPU
    without the instructions). `kernel` None asks for the C++ library itself."""
    reason = native.unavailable_reason(kernel)
    if reason is None:
        return None, False
    library_loaded = native.unavailable_reason() is None
    cpu_lacks_it = library_loaded and kernel is not None and kernel not in native.kernel_builds()
    return reason, not cpu_lacks_it


def require_kernels(*kernels: str | None) -> None:
    """Return when every kernel in `kernels` (names of `native.kernel_titles()`; None: the C++ library)
    runs here; else skip the calling test with the reason, or fail it where kernels are required and
    the cause is a build or load failure."""
    for kernel in kernels or (None,):
        reason, build_failed = missing_kernel_reason(kernel)
        if reason is None:
            continue
        what = "the C++ kernels' library" if kernel is None else f"the {native.kernel_titles()[kernel]} kernel"
        if build_failed and kernels_required():
            pytest.fail(f"{what} is unavailable and {REQUIRE_KERNELS_ENV}=1: {reason}", pytrace=False)
        pytest.skip(f"{what} is unavailable: {reason}")


def require_compiler() -> None:
    """Skip the calling test where no C++ compiler is found (fail where kernels are required)."""
    from quasar_hf.ops.c_build import find_compiler

    if find_compiler() is not None:
        return
    reason = "needs a C++ compiler (install g++ or set $CXX)"
    if kernels_required():
        pytest.fail(f"{reason}, and {REQUIRE_KERNELS_ENV}=1", pytrace=False)
    pytest.skip(reason)


def apply_kernel_markers(item: pytest.Item) -> None:
    """`require_kernels` for each `@pytest.mark.kernels(...)` of `item` (conftest runs it before each test)."""
    for marker in item.iter_markers(name="kernels"):
        require_kernels(*marker.args)
