"""Run untrusted generated Python in a separate process: temporary folder, timeout, resource limits.

Model-written code is never executed in the evaluating process. `run_python` writes the program
into a fresh temporary folder, starts `python -I` there (isolated mode: no user site, no
PYTHONPATH, the cwd not on sys.path) in its own process group with a scrubbed environment,
closed stdin and, on POSIX, limits on memory, CPU time, file size and core dumps; on timeout the
whole process group is killed. A program passes only if it exits 0 *and* printed a random token
that the harness appends after the tests, so code that calls `sys.exit(0)` early cannot pass.
This is a guard against accidents (infinite loops, memory blow-ups, stray files), not a security
boundary against hostile code: run unknown models' code in a container as well.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PASSED, FAILED, TIMED_OUT = "passed", "failed", "timed out"
MEMORY_LIMIT_BYTES = 2 * 1024**3
FILE_SIZE_LIMIT_BYTES = 16 * 1024**2
OUTPUT_KEEP_CHARS = 2000


@dataclass
class RunResult:
    status: str  # PASSED | FAILED | TIMED_OUT
    returncode: int | None
    detail: str  # the end of stderr (why it failed), or "" when it passed


# Runs in the child before the program: caps address space, CPU time and written file size, and
# disables core dumps (rlimits set here, not in a preexec_fn, which is unsafe in a threaded parent).
_LAUNCHER = """
import runpy, sys
try:
    import resource
    for name, value in {limits!r}:
        try:
            resource.setrlimit(getattr(resource, name), (value, value))
        except (ValueError, OSError):
            pass
except ImportError:
    pass
sys.argv = [{script!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def run_python(program: str, timeout_s: float = 10.0) -> RunResult:
    """Run `program` in a subprocess in a temporary folder; PASSED only on exit 0 after all of it ran."""
    token = secrets.token_hex(16)
    source = program + f"\n\nprint({token!r})\n"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }
    with tempfile.TemporaryDirectory(prefix="quasar_hf_exec_") as folder:
        script = Path(folder) / "program.py"
        script.write_text(source, encoding="utf-8")
        posix = os.name == "posix"
        limits = [
            ("RLIMIT_AS", MEMORY_LIMIT_BYTES),
            ("RLIMIT_CPU", int(timeout_s) + 1),
            ("RLIMIT_FSIZE", FILE_SIZE_LIMIT_BYTES),
            ("RLIMIT_CORE", 0),
        ]
        launcher = _LAUNCHER.format(limits=limits, script=str(script))
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", launcher],
            cwd=folder,
            env={**env, "HOME": folder, "TMPDIR": folder},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=posix,
        )
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(process, posix)
            process.communicate()
            return RunResult(TIMED_OUT, None, f"no result within {timeout_s:g} s")
    out = stdout.decode("utf-8", "replace")
    err = stderr.decode("utf-8", "replace")[-OUTPUT_KEEP_CHARS:]
    if process.returncode == 0 and token in out:
        return RunResult(PASSED, 0, "")
    if process.returncode == 0:
        err = (err + "\nexited before the tests finished").strip()
    return RunResult(FAILED, process.returncode, err)


def _kill(process: subprocess.Popen, posix: bool) -> None:
    """Kill the program and anything it started (its process group)."""
    try:
        if posix:
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    except (ProcessLookupError, PermissionError):
        pass
