"""The one decision between skipping and failing a test whose C kernel is missing (tests/helpers/kernels.py)."""

from __future__ import annotations

import pytest

from quasar_hf.ops import native
from tests.helpers import kernels
from tests.helpers.kernels import REQUIRE_KERNELS_ENV, require_kernels

BUILD_FAILED = "building the C++ kernels failed: g++: not found (test)"


@pytest.fixture
def library_failed(monkeypatch):
    """The C++ library as it is where g++ failed: no kernel at all."""
    monkeypatch.setattr(native, "unavailable_reason", lambda kernel=None: BUILD_FAILED)
    monkeypatch.setattr(native, "kernel_builds", dict)


@pytest.fixture
def cpu_without_prefill_build(monkeypatch):
    """The library loaded, but this CPU runs no build of the prompt kernel (no AVX512-BF16)."""
    reasons = {None: None, "prefill_attention": "no build of the prefill attention kernel runs on this CPU (test)"}
    monkeypatch.setattr(native, "unavailable_reason", lambda kernel=None: reasons.get(kernel))
    monkeypatch.setattr(native, "kernel_builds", lambda: {"w8a8": ("vnni", "w8a8_vnni.c")})


@pytest.mark.parametrize("kernel", [None, "w8a8", "attention"])
def test_a_kernel_that_did_not_build_fails_where_kernels_are_required(monkeypatch, library_failed, kernel):
    monkeypatch.setenv(REQUIRE_KERNELS_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="QUASAR_HF_REQUIRE_KERNELS=1: building the C\\+\\+ kernels failed"):
        require_kernels(kernel)


@pytest.mark.parametrize("setting", [None, "0", ""])
def test_a_kernel_that_did_not_build_skips_naming_the_cause_otherwise(monkeypatch, library_failed, setting):
    if setting is None:
        monkeypatch.delenv(REQUIRE_KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(REQUIRE_KERNELS_ENV, setting)
    with pytest.raises(pytest.skip.Exception, match="g\\+\\+: not found"):
        require_kernels("w8a8")


def test_a_kernel_that_fails_its_smoke_test_fails_where_kernels_are_required(monkeypatch):
    mismatch = "the C++ w8a8_linear_cpu_packed disagrees with its reference on a smoke test (compiler problem)"
    monkeypatch.setattr(native, "unavailable_reason", lambda kernel=None: mismatch if kernel == "w8a8" else None)
    monkeypatch.setattr(native, "kernel_builds", lambda: {"w8a8": ("vnni", "w8a8_vnni.c")})
    monkeypatch.setenv(REQUIRE_KERNELS_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="smoke test"):
        require_kernels("w8a8")


def test_a_cpu_without_the_instructions_skips_even_where_kernels_are_required(monkeypatch, cpu_without_prefill_build):
    monkeypatch.setenv(REQUIRE_KERNELS_ENV, "1")
    with pytest.raises(pytest.skip.Exception, match="no build of the prefill attention kernel runs on this CPU"):
        require_kernels("prefill_attention")
    require_kernels("w8a8", None)  # what this CPU runs passes through


def test_every_kernel_named_must_run(monkeypatch, cpu_without_prefill_build):
    monkeypatch.delenv(REQUIRE_KERNELS_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="prefill attention"):
        require_kernels("w8a8", "prefill_attention")


class _Item:
    """What `pytest_runtest_setup` reads of a test item: its `kernels` markers."""

    def __init__(self, *markers):
        self.markers = markers

    def iter_markers(self, name):
        return (m for m in self.markers if m.name == name)


def test_the_kernels_marker_goes_through_the_helper(monkeypatch, library_failed):
    monkeypatch.setenv(REQUIRE_KERNELS_ENV, "1")
    with pytest.raises(pytest.fail.Exception):
        kernels.apply_kernel_markers(_Item(pytest.mark.kernels("rowstable_linear").mark))
    monkeypatch.setenv(REQUIRE_KERNELS_ENV, "0")
    with pytest.raises(pytest.skip.Exception):
        kernels.apply_kernel_markers(_Item(pytest.mark.kernels().mark))
    kernels.apply_kernel_markers(_Item(pytest.mark.slow.mark))  # other markers: nothing to decide


def test_without_a_compiler_the_cache_tests_skip_or_fail(monkeypatch):
    monkeypatch.setattr("quasar_hf.ops.c_build.find_compiler", lambda: None)
    monkeypatch.delenv(REQUIRE_KERNELS_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs a C\\+\\+ compiler"):
        kernels.require_compiler()
    monkeypatch.setenv(REQUIRE_KERNELS_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="needs a C\\+\\+ compiler"):
        kernels.require_compiler()
