"""Ahead-of-time sm_90 builds of our Triton kernels, without a GPU: the PTX the tests inspect."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_outside_the_interpreter(test_file: str, test_name: str) -> bool:
    """In an interpreted session (TRITON_INTERPRET=1, read once at triton's import), run `test_name`
    in a child process without it and assert it passed; returns True when it did so (the caller returns)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{test_file}::{test_name}"],
                           env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert child.returncode == 0 and " passed" in child.stdout, child.stdout[-4000:] + child.stderr[-2000:]
    return True


def hopper_ptx(kernel, signature: dict[str, str], constants: dict, num_warps: int = 4) -> str:
    """PTX of `kernel` (a triton.jit function) built for sm_90 with the launch options our kernels use;
    skips the test on a triton whose ahead-of-time API differs."""
    triton = pytest.importorskip("triton", reason="triton is not installed")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as err:
        pytest.skip(f"this triton has no ahead-of-time compile API: {err}")
    source = ASTSource(fn=kernel, signature={**signature, **dict.fromkeys(constants, "constexpr")}, constexprs=constants)
    try:
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "enable_fp_fusion": False}
        )
    except (TypeError, KeyError) as err:  # signature format of another triton release
        pytest.skip(f"this triton's ahead-of-time compile API differs: {err!r}")
    return compiled.asm["ptx"]
