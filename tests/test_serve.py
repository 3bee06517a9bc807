"""`quasar-hf serve` and `transformers serve --continuous-batching` on a tiny Quasar checkpoint, driven by
the real `openai` client on 127.0.0.1 (a free port): chat and completions, streamed and not, stop strings,
max_tokens, seeded sampling, concurrent clients, a client that goes away, malformed requests; greedy
responses equal offline generate. Each test module starts its own server and stops it."""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.hub import saved_quasar_tiny
from tests.helpers.server_process import ServerProcess, free_port

openai = pytest.importorskip("openai", reason="the server tests use the openai client (transformers[serving])")
pytest.importorskip("fastapi", reason="serving needs transformers[serving]")
pytest.importorskip("uvicorn", reason="serving needs transformers[serving]")

MESSAGES = [[{"role": "user", "content": text}] for text in ("abcabcabc abcabc", "hello hello hello", "the cat sat, the cat")]


class Server(ServerProcess):
    """A server process on 127.0.0.1 (the benchmark's: started, waited for, stopped), with the client's URL."""

    def __init__(self, command: list[str], port: int, log: Path) -> None:
        super().__init__(command, port, log, timeout_s=240)

    @property
    def url(self) -> str:
        return f"{self.base}/v1"

    def client(self):
        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{label="value"}': value} (prometheus_client's parser)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as response:
            families = text_string_to_metric_families(response.read().decode())
        return {
            sample.name
            + (
                "{" + ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())) + "}" if sample.labels else ""
            ): sample.value
            for family in families
            for sample in family.samples
        }

    def post(self, path: str, body: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(f"{self.url}{path}", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return saved_quasar_tiny(tmp_path_factory.mktemp("served") / "tiny-quasar", tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def offline(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    def greedy(messages, max_tokens: int) -> str:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, quasar=False)
        return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)

    return greedy


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    port = free_port()
    command = [sys.executable, "-m", "quasar_hf.cli", "serve", str(checkpoint), "--port", str(port)]
    running = Server(command, port, tmp_path_factory.mktemp("log") / "serve.log")
    yield running
    running.stop()


def chat(client, checkpoint, messages, **options):
    options = {"max_tokens": 12, "temperature": 0, **options}
    return client.chat.completions.create(model=str(checkpoint), messages=messages, **options)


def test_chat_streamed_and_not_equals_offline_greedy(server, checkpoint, offline):
    client = server.client()
    for messages in MESSAGES:
        expected = offline(messages, 12)
        reply = chat(client, checkpoint, messages)
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens <= 12
        stream = chat(client, checkpoint, messages, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_completions_max_tokens(server, checkpoint):
    """Stop strings: tests/test_serve_guards.py (cut from the text, streamed and not)."""
    client = server.client()
    full = client.completions.create(model=str(checkpoint), prompt="abcabcabcabc", max_tokens=10, temperature=0)
    short = client.completions.create(model=str(checkpoint), prompt="abcabcabcabc", max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and full.usage.completion_tokens == 10
    assert full.choices[0].text.startswith(short.choices[0].text) and short.choices[0].finish_reason == "length"


def test_seeded_sampling_repeats_and_concurrent_greedy_clients_equal_one_at_a_time(server, checkpoint, offline):
    client = server.client()
    sampling = {"generation_config": json.dumps({"do_sample": True, "temperature": 1.5, "max_new_tokens": 16})}

    def sampled(seed: int) -> str:
        reply = client.chat.completions.create(model=str(checkpoint), messages=MESSAGES[0], seed=seed, extra_body=sampling)
        return reply.choices[0].message.content

    assert sampled(7) == sampled(7) != sampled(8)
    replies: dict[int, str] = {}

    def ask(index: int) -> None:
        replies[index] = chat(server.client(), checkpoint, MESSAGES[index % 3], max_tokens=10).choices[0].message.content

    before = server.metrics()
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [replies[i] for i in range(6)] == [offline(MESSAGES[i % 3], 10) for i in range(6)]
    after = server.metrics()
    steps = after["quasar_batch_rows_count"] - before["quasar_batch_rows_count"]
    lone = after['quasar_batch_rows_bucket{le="1.0"}'] - before.get('quasar_batch_rows_bucket{le="1.0"}', 0)
    assert steps > lone  # some steps decoded several requests together


def test_a_client_that_goes_away_mid_stream_then_a_normal_request(server, checkpoint, offline):
    before = server.metrics()
    stream = chat(server.client(), checkpoint, MESSAGES[1], max_tokens=1500, stream=True)
    next(iter(stream))
    stream.close()  # the client disconnects: its row stops
    assert chat(server.client(), checkpoint, MESSAGES[2]).choices[0].message.content == offline(MESSAGES[2], 12)
    after = server.metrics()
    assert (
        after['quasar_requests_finished_total{reason="cancelled"}']
        == before.get('quasar_requests_finished_total{reason="cancelled"}', 0) + 1
    )
    assert after["quasar_generation_tokens_total"] - before["quasar_generation_tokens_total"] < 1500


def test_malformed_requests_get_a_4xx_json_error_and_the_server_keeps_serving(server, checkpoint, offline):
    body = {"model": str(checkpoint), "messages": MESSAGES[0], "max_tokens": 5}
    status, error = server.post("/chat/completions", b'{"model": "x", "messages": [')
    assert 400 <= status < 500 and error
    status, error = server.post("/chat/completions", json.dumps({**body, "model": "no-such-model"}).encode())
    assert 400 <= status < 500 and "no-such-model" in json.dumps(error)
    status, error = server.post("/chat/completions", json.dumps({**body, "max_tokens": -3}).encode())
    assert status == 400 and "max_tokens" in json.dumps(error)
    assert chat(server.client(), checkpoint, MESSAGES[0]).choices[0].message.content == offline(MESSAGES[0], 12)


def test_transformers_serve_continuous_batching_answers_with_quasar(checkpoint, offline, tmp_path):
    """Transformers' own CLI: its continuous batching calls the model's init_continuous_batching (a RequestBatcher)."""
    port = free_port()
    command = [
        sys.executable,
        "-c",
        "import sys; from transformers.cli.transformers import main; sys.argv = ['transformers', *sys.argv[1:]]; main()",
        "serve",
        str(checkpoint),
        "--continuous-batching",
        "--trust-remote-code",
        "--device",
        "cpu",
        "--port",
        str(port),
    ]
    running = Server(command, port, tmp_path / "transformers-serve.log")
    try:
        client = running.client()
        assert chat(client, checkpoint, MESSAGES[0]).choices[0].message.content == offline(MESSAGES[0], 12)
        stream = chat(client, checkpoint, MESSAGES[1], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == offline(MESSAGES[1], 12)
    finally:
        running.stop()
    assert "You are using a model of type" not in (tmp_path / "transformers-serve.log").read_text()


def test_offline_reference_is_plain_decoding(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert out.quasar_stats is not None  # served checkpoints decode with Quasar by default
