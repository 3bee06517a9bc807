"""`quasar-hf doctor`: which kernels run on this machine, which do not and why, and the versions
that decide it (a slower fallback is never silent: this is where to look first)."""

from __future__ import annotations

import importlib.metadata
import platform
import sys


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """Python, quasar-hf, torch (and its CUDA), transformers, triton, bitsandbytes, the C++ compiler."""
    import torch

    from quasar_hf.ops.c_build import find_compiler

    if torch.cuda.is_available():
        cuda = f"{torch.version.cuda} ({torch.cuda.get_device_name(0)})"
    else:
        cuda = f"{torch.version.cuda or 'none'} in the torch build; no CUDA device visible"
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "quasar-hf": _version("quasar-hf"),
        "torch": torch.__version__,
        "CUDA": cuda,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "bitsandbytes": _version("bitsandbytes"),
        "C++ compiler": find_compiler() or "none found (the ops run their plain-PyTorch implementations)",
    }


def doctor_report() -> str:
    """The whole report as text: versions, then one line per kernel backend and device."""
    from quasar_hf.ops.backend_report import backend_report

    lines = ["Versions"]
    lines += [f"  {name:<13} {value}" for name, value in versions().items()]
    rows = backend_report()
    titles = (
        ("w8a8_linear", "W8A8 linear backends (* = what backend='auto' uses)"),
        ("attention", "Attention for verification (* = what Quasar models run)"),
        ("lm_head", "Float lm_head of Quasar models (* = what they run; row-stable: verify rows equal decode steps)"),
        ("op", "quasar:: ops (* = the implementation serving that device; without the C++ one, the Python one)"),
    )
    for kernel, title in titles:
        lines += ["", title]
        width = max([17] + [len(r.name) for r in rows if r.kernel == kernel])
        for row in (r for r in rows if r.kernel == kernel):
            mark = "*" if row.auto else " "
            state = "usable" if row.usable else f"unavailable: {row.reason}"
            lines.append(f"  {mark} {row.device:<5} {row.name:<{width}} {state}")
    return "\n".join(lines)


def run_doctor() -> int:
    """Print the report; exit code 0 (the report is informational, a fallback is not an error)."""
    print(doctor_report())
    sys.stdout.flush()
    return 0
