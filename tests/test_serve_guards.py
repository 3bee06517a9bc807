"""`quasar-hf serve` against careless and hostile clients, on a tiny Quasar checkpoint with a long context, driven
by the real `openai` client and raw HTTP on 127.0.0.1: no endpoint loads other code, no request holds the worker
without bound, one request's fault fails only that request, OpenAI's sampling rule holds, bad input gets 400 with
the reason, stop strings are left out, and the operator's limits (API key, queue, time) and /health, /metrics work.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.hub import saved_quasar_tiny
from tests.helpers.server_process import ServerProcess, free_port

openai = pytest.importorskip("openai", reason="the server tests use the openai client (transformers[serving])")
pytest.importorskip("fastapi", reason="serving needs transformers[serving]")
parser = pytest.importorskip("prometheus_client.parser", reason="/metrics is read with prometheus_client's parser")

CONTEXT = 65536  # long enough that an unbounded request would hold the worker for minutes
KEY = "test-key-123"
MESSAGES = [{"role": "user", "content": "abcabcabc abcabc"}]


class Server(ServerProcess):
    def __init__(self, checkpoint: Path, log: Path, *flags: str) -> None:
        port = free_port()
        command = [sys.executable, "-m", "quasar_hf.cli", "serve", str(checkpoint), "--port", str(port), *flags]
        self.command = command
        super().__init__(command, port, log, timeout_s=240)

    def client(self, api_key: str = "none", timeout: float = 120):
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=api_key, max_retries=0, timeout=timeout)

    def http(self, method: str, path: str, body: dict | str | None = None, key: str | None = None):
        """(status, headers, parsed body) of one raw request."""
        data = None if body is None else (body if isinstance(body, str) else json.dumps(body)).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(f"{self.base}{path}", data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, dict(response.headers), response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read().decode()

    def metrics(self, key: str | None = None) -> dict[tuple[str, tuple], float]:
        status, _, text = self.http("GET", "/metrics", key=key)
        assert status == 200
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in parser.text_string_to_metric_families(text)
            for sample in family.samples
        }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = saved_quasar_tiny(tmp_path_factory.mktemp("served") / "tiny-quasar", tmp_path_factory.mktemp("base"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return folder


@pytest.fixture(scope="module")
def offline(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    def greedy_text(prompt: str, max_tokens: int) -> str:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, quasar=False)
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    return greedy_text


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    running = Server(checkpoint, tmp_path_factory.mktemp("log") / "serve.log", "--max-batch-size", "4")
    yield running
    running.stop()


def test_no_endpoint_loads_other_code(server, tmp_path):
    marker = tmp_path / "imported"
    evil = tmp_path / "evil-model"
    evil.mkdir()
    (evil / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    (evil / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    assert server.http("POST", "/load_model", {"model": str(evil)})[0] == 403
    assert server.http("POST", "/reset", {})[0] == 403
    assert server.http("GET", "/openapi.json")[0] == 404 and server.http("GET", "/docs")[0] == 404
    status, _, body = server.http("POST", "/v1/chat/completions", {"model": str(evil), "messages": MESSAGES})
    assert status == 400 and "pinned" in body
    refused = subprocess.run(
        [sys.executable, "-m", "quasar_hf.cli", "serve", str(evil), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert refused.returncode != 0 and "trust_remote_code" in refused.stderr + refused.stdout
    assert not marker.exists()


def test_max_tokens_and_prompts_past_the_context_are_refused(server, checkpoint):
    status, _, body = server.http("POST", "/v1/completions", {"model": str(checkpoint), "prompt": "abc", "max_tokens": 10**9})
    assert status == 400 and "1000000000" in body and str(CONTEXT) in body
    status, _, body = server.http("POST", "/v1/completions", {"model": str(checkpoint), "prompt": "ab" * CONTEXT})
    assert status == 400 and str(CONTEXT) in body and "prompt" in body


def test_a_non_streamed_request_whose_client_leaves_is_cancelled(server, checkpoint, offline):
    before = server.metrics()
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=2).completions.create(model=str(checkpoint), prompt="abcabc", max_tokens=60000, temperature=0)
    reply = server.client().completions.create(model=str(checkpoint), prompt="hello", max_tokens=4, temperature=0)
    assert reply.choices[0].text == offline("hello", 4)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = server.metrics()
        if after.get(("quasar_requests_finished_total", (("reason", "cancelled"),)), 0) > before.get(
            ("quasar_requests_finished_total", (("reason", "cancelled"),)), 0
        ):
            break
        time.sleep(0.2)
    generated = after[("quasar_generation_tokens_total", ())] - before.get(("quasar_generation_tokens_total", ()), 0)
    assert after[("quasar_requests_finished_total", (("reason", "cancelled"),))] >= 1 and generated < 60000


def test_an_empty_prompt_fails_only_its_own_request(server, checkpoint, offline):
    prompts = ["abcabcabc", "", "hello hello", "the cat sat"]
    for _ in range(2):
        results: dict[int, tuple] = {}

        def ask(index: int) -> None:
            body = {"model": str(checkpoint), "prompt": prompts[index], "max_tokens": 8, "temperature": 0}
            results[index] = server.http("POST", "/v1/completions", body)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert results[1][0] == 400 and "empty" in results[1][2]
        for index in (0, 2, 3):
            status, _, body = results[index]
            assert status == 200 and json.loads(body)["choices"][0]["text"] == offline(prompts[index], 8)


def test_temperature_samples_and_a_seed_reproduces_it(server, checkpoint):
    client = server.client()

    def reply(**options) -> str:
        answer = client.chat.completions.create(model=str(checkpoint), messages=MESSAGES, max_tokens=16, **options)
        return answer.choices[0].message.content

    greedy = reply(temperature=0)
    first, again, other = reply(temperature=0.9, seed=1234), reply(temperature=0.9, seed=1234), reply(temperature=0.9, seed=99)
    assert first == again and first != other and greedy not in (first, other)


BAD_BODIES = [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": []}, "messages"),
    ({"generation_config": "not json"}, "JSON"),
    ({"generation_config": "[1]"}, "JSON object"),
    ({"generation_config": json.dumps({"quasar": {"num_draft_tokens": -3}})}, "num_draft_tokens"),
    ({"generation_config": json.dumps({"quasar": "yes"})}, "quasar"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"n": 2}, "n must be 1"),
    ({"logprobs": True}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
]


def test_bad_input_gets_400_with_the_reason(server, checkpoint):
    for fields, reason in BAD_BODIES:
        status, _, body = server.http("POST", "/v1/chat/completions", {"model": str(checkpoint), "messages": MESSAGES, **fields})
        assert status == 400 and reason in body, (fields, status, body)
    status, _, body = server.http("POST", "/v1/completions", {"model": str(checkpoint), "prompt": ""})
    assert status == 400 and "empty" in body


def test_stop_strings_are_left_out_of_the_text(server, checkpoint):
    client = server.client()
    ask = dict(model=str(checkpoint), prompt="abcabcabcabc", max_tokens=24, temperature=1.5, seed=11)  # varied text
    full = client.completions.create(**ask).choices[0].text
    start = next(i for i in range(1, len(full) - 1) if full[i].strip() and full.find(full[i]) == i)
    stop = full[start]
    assert client.completions.create(**ask, stop=[stop]).choices[0].text == full[:start]
    streamed = "".join(
        chunk.choices[0].text for chunk in client.completions.create(**ask, stop=[stop], stream=True) if chunk.choices
    )
    assert streamed == full[:start]


def test_metrics_count_requests_tokens_and_drafts(server, checkpoint):
    server.client().completions.create(model=str(checkpoint), prompt="abcabcabcabcabc", max_tokens=12, temperature=0)
    samples = server.metrics()
    assert samples[("quasar_requests_finished_total", (("reason", "stop"),))] >= 1
    assert samples[("quasar_generation_tokens_total", ())] >= 12 and samples[("quasar_prompt_tokens_total", ())] >= 15
    assert samples[("quasar_spec_draft_tokens_total", ())] >= samples[("quasar_spec_accepted_tokens_total", ())] > 0
    assert samples[("quasar_requests_running", ())] == 0 and samples[("quasar_queue_wait_seconds_count", ())] >= 1


def test_a_chats_next_turn_reuses_its_history_from_the_prompt_cache(server, checkpoint):
    client = server.client()
    before = server.metrics()
    history = [{"role": "user", "content": "abcabcabc abcabcabc abc"}]
    first = client.chat.completions.create(model=str(checkpoint), messages=history, max_tokens=12, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "abc again"}]
    second = client.chat.completions.create(model=str(checkpoint), messages=history, max_tokens=12, temperature=0)
    after = server.metrics()
    reused = after[("quasar_prompt_cache_tokens_reused_total", ())] - before.get(
        ("quasar_prompt_cache_tokens_reused_total", ()), 0
    )
    assert after[("quasar_prompt_cache_hits_total", ())] >= 1 and reused >= first.usage.prompt_tokens
    assert reused < second.usage.prompt_tokens and after[("quasar_prompt_cache_bytes", ())] > 0


@pytest.fixture(scope="module")
def limited(checkpoint, tmp_path_factory):
    flags = ("--api-key", KEY, "--max-queued", "1", "--max-batch-size", "1", "--request-timeout", "3")
    running = Server(checkpoint, tmp_path_factory.mktemp("log") / "limited.log", *flags)
    yield running
    running.stop()


def test_the_api_key_is_required_but_for_health(limited, checkpoint):
    with pytest.raises(openai.AuthenticationError):
        limited.client().completions.create(model=str(checkpoint), prompt="abc", max_tokens=2)
    assert limited.http("GET", "/health")[0] == 200 and limited.http("GET", "/metrics")[0] == 401
    reply = limited.client(KEY).completions.create(model=str(checkpoint), prompt="abc", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2


def test_a_request_past_its_time_ends_with_its_tokens_so_far(limited, checkpoint):
    began = time.monotonic()
    reply = limited.client(KEY).completions.create(model=str(checkpoint), prompt="abcabc", max_tokens=60000, temperature=0)
    assert time.monotonic() - began < 30
    assert reply.choices[0].finish_reason == "length" and 0 < reply.usage.completion_tokens < 60000


def test_past_the_queue_limit_a_request_gets_429_with_retry_after(limited, checkpoint):
    client = limited.client(KEY)
    running = client.completions.create(model=str(checkpoint), prompt="abcabc", max_tokens=60000, temperature=0, stream=True)
    next(iter(running))  # decoding now (it runs until its 3 s limit)
    waiting = threading.Thread(
        target=lambda: client.completions.create(model=str(checkpoint), prompt="x", max_tokens=2, temperature=0)
    )
    waiting.start()
    deadline = time.monotonic() + 10
    while limited.metrics(KEY)[("quasar_requests_waiting", ())] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    status, headers, body = limited.http("POST", "/v1/completions", {"model": str(checkpoint), "prompt": "y"}, key=KEY)
    assert status == 429 and int(headers["retry-after"]) >= 1 and "max-queued" in body
    for _ in running:
        pass
    waiting.join(60)


def test_a_servers_life_503_while_loading_a_port_in_use_and_sigterm_within_10_s(checkpoint, tmp_path):
    """/health is 503 until the model is ready; a second server on the port fails before loading; SIGTERM ends the
    running row (its tokens so far), answers the waiting request 503 and exits within 10 s."""
    port = free_port()
    command = [sys.executable, "-m", "quasar_hf.cli", "serve", str(checkpoint), "--port", str(port), "--max-batch-size", "1"]
    process = subprocess.Popen(command, stdout=(tmp_path / "serve.log").open("w"), stderr=subprocess.STDOUT)
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while (not seen or seen[-1] != 200) and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    seen.append(response.status)
            except urllib.error.HTTPError as error:
                seen.append(error.code)
            except OSError:
                time.sleep(0.02)
        assert 503 in seen and seen[-1] == 200
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert second.returncode != 0 and f"{port}" in second.stderr and "--port" in second.stderr
        assert "loaded" not in second.stderr

        server = Server.__new__(Server)  # the running process, driven with this module's client helpers
        server.port, server.process = port, process
        running = server.client().completions.create(
            model=str(checkpoint), prompt="abcabc", max_tokens=60000, temperature=0, stream=True
        )
        chunks = iter(running)
        next(chunks)
        waiting: dict = {}

        def wait_in_queue() -> None:
            waiting["reply"] = server.http("POST", "/v1/completions", {"model": str(checkpoint), "prompt": "x", "max_tokens": 4})

        thread = threading.Thread(target=wait_in_queue)
        thread.start()
        deadline = time.monotonic() + 10
        while server.metrics()[("quasar_requests_waiting", ())] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        began = time.monotonic()
        os.kill(process.pid, signal.SIGTERM)
        for _ in chunks:  # the running stream ends (its tokens so far)
            pass
        process.wait(20)
        assert time.monotonic() - began < 10
        thread.join(10)
        assert waiting["reply"][0] == 503
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
