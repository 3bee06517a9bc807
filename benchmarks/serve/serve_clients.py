"""Servers and load clients for `python -m benchmarks serve-load`: start a server process on 127.0.0.1, send
it requests from N concurrent clients, time each one (first token, whole response) and sample its RSS.

Two wire formats: the OpenAI API that `quasar-hf serve` and `transformers serve` answer (chat or text
completions, streamed), and llama.cpp's native `/completion`, which takes the prompt as token ids (the
checkpoint's own, so every server decodes the same tokens) and never reuses a cached prefix
(`cache_prompt: false`: no other server does).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.server_process import ServerProcess, free_port  # noqa: F401  (re-exported: the clients' servers)


def rss_bytes(pid: int, field_name: str = "VmRSS") -> int | None:
    """A process's resident set (VmRSS) or its peak (VmHWM), from /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class Prompt:
    """One benchmark prompt in both wire formats: chat messages or raw text, and its token ids."""

    id: str
    ids: list[int]
    messages: list[dict] | None = None
    text: str | None = None


@dataclass
class Outcome:
    """One request: when it started, its first token and its end (seconds), its text and token count."""

    prompt: str
    started: float
    first_token: float | None = None
    ended: float | None = None
    text: str = ""
    tokens: int = 0
    error: str | None = None
    rss: int | None = None


@dataclass
class Wire:
    """How to ask a server for one response: `openai` (model name, extra body fields) or `llamacpp`."""

    kind: str
    model: str = ""
    extra: dict = field(default_factory=dict)


def request_once(connection: http.client.HTTPConnection, wire: Wire, prompt: Prompt, max_tokens: int) -> Outcome:
    """Send one streamed greedy request and time it."""
    outcome = Outcome(prompt.id, time.perf_counter())
    try:
        if wire.kind == "llamacpp":
            path = "/completion"
            body = {"prompt": prompt.ids, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "stream": True}
            body.update(cache_prompt=False, ignore_eos=False)
        elif prompt.messages is not None:
            path = "/v1/chat/completions"
            body = {"model": wire.model, "messages": prompt.messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        else:
            path = "/v1/completions"
            body = {"model": wire.model, "prompt": prompt.text, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        body.update(wire.extra)
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            outcome.error = f"HTTP {response.status}: {response.read()[:300]!r}"
            return outcome
        for raw in response:
            _read_event(raw.decode("utf-8").rstrip("\r\n"), wire.kind, outcome)
        if outcome.error is None and outcome.ended is None:
            outcome.ended = time.perf_counter()
    except (OSError, http.client.HTTPException, ValueError) as error:
        outcome.error = f"{type(error).__name__}: {error}"
        connection.close()
    return outcome


def _read_event(line: str, kind: str, outcome: Outcome) -> None:
    if not line.startswith("data: ") or line.strip() == "data: [DONE]":
        return
    event = json.loads(line[len("data: ") :])
    if "error" in event:
        outcome.error = str(event["error"])[:300]
        return
    if kind == "llamacpp":
        piece = event.get("content", "")
        if event.get("stop"):
            outcome.tokens = int(event.get("tokens_predicted", outcome.tokens))
            outcome.ended = time.perf_counter()
    else:
        choice = (event.get("choices") or [{}])[0]
        piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if event.get("usage"):
            outcome.tokens = int(event["usage"].get("completion_tokens", 0))
    if piece and outcome.first_token is None:
        outcome.first_token = time.perf_counter()
    outcome.text += piece


def from_clients(count: int, clients: int, work: Callable[[int], None]) -> float:
    """Call work(0..count-1) from `clients` threads, each taking the next index when its last call ends; the wall time."""
    lock, order = threading.Lock(), iter(range(count))

    def client_loop() -> None:
        while True:
            with lock:
                index = next(order, None)
            if index is None:
                return
            work(index)

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def run_level(base: str, wire: Wire, prompts: list[Prompt], clients: int, requests: int, max_tokens: int, pid: int) -> dict:
    """`requests` requests from `clients` concurrent clients (each sends its next request when its last one
    ends), prompts taken in order; the outcomes and the level's wall time."""
    outcomes: list[Outcome | None] = [None] * requests
    host, port = base.removeprefix("http://").split(":")

    def one(index: int) -> None:
        connection = http.client.HTTPConnection(host, int(port), timeout=600)  # one per request: some servers close
        outcome = request_once(connection, wire, prompts[index % len(prompts)], max_tokens)
        connection.close()
        outcome.rss = rss_bytes(pid)
        outcomes[index] = outcome

    return {"wall_s": from_clients(requests, clients, one), "outcomes": outcomes}


class MetricsScraper:
    """Within the block, GET `base`/metrics every `seconds` (as a Prometheus server scrapes) and parse each reply
    with prometheus_client's text parser; `scrapes` counts the replies that parsed, `failures` the others."""

    def __init__(self, base: str, seconds: float) -> None:
        self.base, self.seconds = base, seconds
        self.scrapes = self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> MetricsScraper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        host, port = self.base.removeprefix("http://").split(":")
        while not self._stop.wait(self.seconds):
            try:
                connection = http.client.HTTPConnection(host, int(port), timeout=30)
                connection.request("GET", "/metrics")
                body = connection.getresponse().read().decode()
                connection.close()
                families = list(text_string_to_metric_families(body))
                self.scrapes += 1 if families else 0
                self.failures += 0 if families else 1
            except Exception:  # noqa: BLE001 - a failed scrape is counted, never fatal to the load
                self.failures += 1
