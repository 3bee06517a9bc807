"""The op table (quasar_hf/ops/torch_ops.py): every quasar:: op passes opcheck on its sample arguments,
the C++ library serves the CPU key of each op it implements, and without a C++ compiler the ops keep
their plain-PyTorch implementations, which compute the C++ ones' bits (attention: within its
tolerance), and a W8A8 model still runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from quasar_hf.ops import native
from quasar_hf.ops.torch_ops import OPS

needs_cpu_fused = pytest.mark.kernels("w8a8")


def test_every_registered_op_is_in_the_table():
    registered = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("quasar::") and "::native_" not in n}
    assert registered == {f"quasar::{op.name}" for op in OPS}


@needs_cpu_fused
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_every_op_passes_opcheck_on_its_sample(op):
    args = op.sample(torch.Generator().manual_seed(0))
    torch.library.opcheck(getattr(torch.ops.quasar, op.name).default, args, test_utils=("test_schema", "test_faketensor"))
    if op.kernel and native.is_available():  # the C++ implementation serves CPU tensors
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"quasar::{op.name}", "CPU")


# A subprocess whose C++ compiler is missing: the library cannot be built, the ops run their
# plain-PyTorch implementations, and a tiny W8A8 model runs on the other backends.
NO_CXX = textwrap.dedent(
    """
    import sys, torch
    from quasar_hf.ops import native
    from quasar_hf.ops.dispatch import resolve_backend
    from quasar_hf.ops.torch_ops import OPS
    from tests.helpers.tiny_models import tiny_logits
    print("reason", native.unavailable_reason())
    print("auto", resolve_backend("auto", "cpu"))
    assert not any(torch._C._dispatch_has_kernel_for_dispatch_key(f"quasar::{op.name}", "CPU") for op in OPS)
    outputs = {op.name: getattr(torch.ops.quasar, op.name)(*op.sample(torch.Generator().manual_seed(0))) for op in OPS}
    logits = tiny_logits()
    assert bool(logits.isfinite().all())
    torch.save(outputs, sys.argv[1])
    """
)


@pytest.mark.kernels()  # compares with the C++ implementations
def test_without_a_cxx_compiler_the_fallbacks_compute_the_cpp_bits(tmp_path):
    out = tmp_path / "outputs.pt"
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", NO_CXX, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reason building the C++ kernels failed" in done.stdout and "auto torch" in done.stdout, done.stdout
    fallbacks = torch.load(out)
    for op in OPS:
        expected = getattr(torch.ops.quasar, op.name)(*op.sample(torch.Generator().manual_seed(0)))  # C++ where it serves
        pairs = zip(fallbacks[op.name], expected, strict=True) if isinstance(expected, list) else [(fallbacks[op.name], expected)]
        for a, b in pairs:
            if op.tolerance:
                assert bool(((a.double() - b.double()).abs() <= op.tolerance * (1 + b.double().abs())).all()), op.name
            else:
                assert a.dtype == b.dtype and torch.equal(a, b), op.name
