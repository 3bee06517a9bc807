"""What can run here: every W8A8 backend, row-stable attention and lm_head kernel, and which
implementation of each quasar:: op serves each device (read from the op table), with reasons."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quasar_hf.ops.dispatch import BACKENDS, _auto_choice, _unavailable_reason


@dataclass(frozen=True)
class BackendStatus:
    """One row of `backend_report()`: a kernel backend on a device type, usable or not and why."""

    kernel: str  # "w8a8_linear", "attention", "lm_head" or "op"
    name: str
    device: str
    usable: bool
    reason: str | None  # why it cannot run (None when usable)
    auto: bool  # what "auto" (or the attention interface) picks on this device


def backend_report() -> list[BackendStatus]:
    """Every W8A8 backend, row-stable attention and lm_head kernel on CPU and CUDA: usable or not, and why."""
    from quasar_hf.ops import attention_cpu, rowstable_linear, triton_attention

    rows = []
    no_cuda = None if torch.cuda.is_available() else "no CUDA device is visible to torch"
    for device_type, missing_device in (("cpu", None), ("cuda", no_cuda)):
        auto = None if missing_device else _auto_choice(device_type)[0]
        for name in BACKENDS:
            reason = missing_device or _unavailable_reason(name, device_type)
            rows.append(BackendStatus("w8a8_linear", name, device_type, reason is None, reason, name == auto))
    # Row-stable attention: the kernel where it runs, else SDPA with row-by-row verification.
    for device_type, name, reason in (
        ("cpu", "rowstable_cpu", attention_cpu.unavailable_reason()),
        ("cuda", "rowstable_triton", no_cuda or triton_attention.unavailable_reason()),
    ):
        sdpa_reason = None if device_type == "cpu" else no_cuda
        rows.append(BackendStatus("attention", name, device_type, reason is None, reason, reason is None))
        rows.append(
            BackendStatus(
                "attention", "sdpa", device_type, sdpa_reason is None, sdpa_reason, reason is not None and sdpa_reason is None
            )
        )
    # The float lm_head of Quasar models: the row-stable C kernel on CPU, else F.linear.
    lm_head_reason = rowstable_linear.unavailable_reason()
    rows.append(BackendStatus("lm_head", "rowstable_cpu", "cpu", lm_head_reason is None, lm_head_reason, lm_head_reason is None))
    rows.append(BackendStatus("lm_head", "f_linear", "cpu", True, None, lm_head_reason is not None))
    rows.append(BackendStatus("lm_head", "f_linear", "cuda", no_cuda is None, no_cuda, no_cuda is None))
    return rows + op_rows(no_cuda)


def op_rows(no_cuda: str | None) -> list[BackendStatus]:
    """Per op of `torch_ops.OPS`: its C++ CPU implementation (ops/native.py: which build of its C kernel
    runs here), its plain-PyTorch one (the CPU fallback, which serves when the C++ one cannot) and its CUDA one."""
    from quasar_hf.ops import native
    from quasar_hf.ops.torch_ops import OPS

    builds = native.kernel_builds()
    rows = []
    for op in OPS:
        cpp_reason = native.op_unavailable_reason(op.name) if op.kernel else None
        if op.kernel:
            build = builds.get(op.kernel)
            label = f"{op.name} c++" + (f" ({build[1]}, {build[0]})" if build and cpp_reason is None else "")
            rows.append(BackendStatus("op", label, "cpu", cpp_reason is None, cpp_reason, cpp_reason is None))
        fallback_serves = not op.kernel or cpp_reason is not None
        rows.append(BackendStatus("op", f"{op.name} python", "cpu", True, None, fallback_serves))
        cuda_reason = no_cuda or (None if op.cuda is not None else "no CUDA implementation (the Python one runs)")
        rows.append(BackendStatus("op", f"{op.name} cuda", "cuda", cuda_reason is None, cuda_reason, cuda_reason is None))
    return rows
