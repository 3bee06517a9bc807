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


def compiled_steps_check() -> str:
    """Compile a small W8A8 step the way `quasar={"compile": True}` does (compat.default_compile_config),
    run it and compare it with eager: "works (N s)", or why it does not and the fix."""
    import time

    import torch

    from quasar_hf import compat
    from quasar_hf.nn import W8A8Linear
    from quasar_hf.speculative import step_compiler

    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    probe = torch.nn.Sequential(W8A8Linear.from_weight(torch.randn(64, 64, generator=generator)), torch.nn.SiLU())
    x = torch.randn(1, 4, 64, generator=generator)
    try:
        step = step_compiler.compiled_step(probe, compat.default_compile_config(torch.device("cpu")), "quasar_doctor_step")
        with torch.no_grad():
            compiled, eager = step(x), probe(x)
    except Exception as error:  # the toolchain's own failure: say what it was and what to do
        first = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        return (
            f"unavailable: {first}. Compiled steps need Inductor's C++ toolchain (g++ or $CXX); "
            "without one, decode eagerly (the default)"
        )
    if not torch.allclose(compiled, eager, atol=1e-5, rtol=1e-4):
        return "unavailable: the compiled step's output differs from eager's; decode eagerly and report this"
    return f"works (a W8A8 step compiled and ran in {time.perf_counter() - started:.1f} s)"


def run_doctor(check_compile: bool = True) -> int:
    """Print the report (with the compiled-steps check unless told not to); exit code 0 (the report is
    informational, a fallback is not an error)."""
    print(doctor_report())
    if check_compile:
        print("\nCompiled steps (quasar={'compile': True}, quasar-hf serve --compile)")
        sys.stdout.flush()
        print(f"  {compiled_steps_check()}")
    sys.stdout.flush()
    return 0
