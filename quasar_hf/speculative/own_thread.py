"""Work in a thread of its own that ends with it (the serving scheduler's background prefill)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


def in_own_thread(function: Callable[..., Any], *args: Any) -> Future:
    """Run `function(*args)` in a new thread that ends with it; its result or error in the Future. A thread per call,
    not a pool: a thread that stays alive keeps the OpenMP team it used, and with more OpenMP threads than cores
    libgomp stops spinning between parallel regions for every team, so each of the decoding thread's many small
    regions waits on a futex (SmolLM2 served one client at 20 ms per step before a burst of long prompts, 37 ms
    after it, for good)."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(function(*args))
            except BaseException as error:  # noqa: BLE001 - handed to the Future's reader
                future.set_exception(error)

    threading.Thread(target=run, name="quasar-prefill", daemon=True).start()
    return future
