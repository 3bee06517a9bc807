"""The kernel harness calls each C entry point with the signature csrc/qhf_entry_points.h declares (read, not copied)."""

from __future__ import annotations

import ctypes
import re

import pytest

from benchmarks.kernels.c_kernels import entry_argtypes
from quasar_hf.ops.native import ENTRY_POINTS


def test_every_entry_point_of_the_header_has_its_argument_types():
    text = ENTRY_POINTS.read_text()
    entries = set(re.findall(r"X\((qhf_\w+), b\)", text))
    assert {"qhf_rowstable_attention", "qhf_rowstable_linear", "qhf_hadamard_rows", "qhf_w8a8_linear"} <= entries
    for entry in entries:
        declared = re.search(rf"\bint {entry}\(([^)]*)\);", text).group(1)
        argtypes = entry_argtypes(entry)
        assert len(argtypes) == declared.count(",") + 1, entry
        assert argtypes.count(ctypes.c_void_p) == sum("*" in p for p in declared.split(",")), entry


def test_the_row_stable_linear_signature_reads_as_declared():
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    assert entry_argtypes("qhf_rowstable_linear") == [p, i64, i64, i64, p, i64, i64, p, p, i64, c_int, c_int]
    assert entry_argtypes("qhf_hadamard_rows")[-2:] == [ctypes.c_float, c_int]  # float scale, int threads


def test_an_entry_point_the_header_does_not_declare_is_refused():
    with pytest.raises(KeyError, match="qhf_no_such_kernel"):
        entry_argtypes("qhf_no_such_kernel")
