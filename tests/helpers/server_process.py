"""A server in a child process on 127.0.0.1, for tests and benchmarks: started, awaited until its health
endpoint answers, stopped."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server started with `command`, ready once `health` answers; stopped by `stop` (or the with-block)."""

    def __init__(self, command: list[str], port: int, log: Path, health: str = "/health", timeout_s: float = 1800) -> None:
        self.port, self.log = port, log
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            command, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited before it served: {log.read_text()[-2000:]}")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                connection.request("GET", health)
                if connection.getresponse().status == 200:
                    self.ready_s = time.perf_counter() - self.started
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{command[0]} did not start in {timeout_s} s: {log.read_text()[-2000:]}")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
