"""What a request body may ask of `quasar-hf serve` (request_checks) and stop strings cut from text (stop_text):
pure functions, checked without a server."""

from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig

from quasar_hf.serving.request_checks import (
    SEED_FIELD,
    RequestError,
    apply_sampling,
    asks_max_tokens,
    check_body,
    token_budget,
)
from quasar_hf.serving.stop_text import StopTextFilter, cut_at_stop

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

REFUSED = [
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "text"),
    ({"generation_config": "not json"}, "not valid JSON"),
    ({"generation_config": "[1, 2]"}, "JSON object"),
    ({"generation_config": json.dumps({"quasar": {"num_draft_tokens": -3}})}, "num_draft_tokens"),
    ({"generation_config": json.dumps({"quasar": "yes"})}, "quasar"),
    ({"generation_config": json.dumps({"top_p": 7, "do_sample": True})}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"n": 2}, "n must be 1"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"stream": "yes"}, "stream"),
]


@pytest.mark.parametrize("fields, named", REFUSED)
def test_a_bad_chat_body_is_refused_naming_the_field(fields, named):
    with pytest.raises(RequestError, match=named):
        check_body({**CHAT, **fields}, "chat")


def test_completions_need_a_string_prompt_and_accept_what_openai_clients_send():
    with pytest.raises(RequestError, match="prompt"):
        check_body({"model": "m", "prompt": ["a", "b"]}, "completions")
    ok = {"model": "m", "prompt": "x", "n": 1, "logprobs": None, "presence_penalty": 0, "stop": ["\n", "END"]}
    check_body(ok, "completions")
    check_body({**CHAT, "response_format": {"type": "text"}, "logprobs": False, "stream": True}, "chat")


@pytest.mark.parametrize(
    "fields, do_sample",
    [
        ({}, None),  # the checkpoint's generation config decides
        ({"temperature": 0}, False),
        ({"temperature": 0.9}, True),
        ({"top_p": 0.5}, True),
        ({"temperature": 0, "top_p": 0.5}, False),
        ({"temperature": 0.9, "generation_config": json.dumps({"do_sample": False})}, None),  # explicit wins
    ],
)
def test_openai_sampling_rule(fields, do_sample):
    assert check_body({**CHAT, **fields}, "chat").do_sample is do_sample


def test_sampling_is_applied_with_the_seed_and_greedy_stays_greedy():
    config = apply_sampling(GenerationConfig(temperature=0.9), check_body({**CHAT, "temperature": 0.9, "seed": 7}, "chat"))
    assert config.do_sample is True and getattr(config, SEED_FIELD) == 7
    greedy = apply_sampling(GenerationConfig(do_sample=True), check_body({**CHAT, "temperature": 0}, "chat"))
    assert greedy.do_sample is False
    kept = apply_sampling(GenerationConfig(do_sample=True, temperature=0.7), check_body(CHAT, "chat"))
    assert kept.do_sample is True


def test_token_budget_fills_the_context_or_refuses_naming_both_numbers():
    assert token_budget(10, None, 2048) == 2038
    assert token_budget(10, 64, 2048) == 64
    with pytest.raises(RequestError, match=r"1000000000.*2048"):
        token_budget(10, 10**9, 2048)
    with pytest.raises(RequestError, match="empty"):
        token_budget(0, 5, 2048)
    with pytest.raises(RequestError, match=r"10866 tokens.*8192"):
        token_budget(10866, None, 8192)
    assert asks_max_tokens({"max_completion_tokens": 5}) and not asks_max_tokens(CHAT)
    assert asks_max_tokens({"generation_config": json.dumps({"max_new_tokens": 3})})


def test_stop_strings_are_cut_from_streamed_text_whatever_the_chunking():
    text, stops = "def f(x):\n    return x\n\nprint(f(2))", ["\n\n", "print("]
    expected = "def f(x):\n    return x"
    assert cut_at_stop(text, stops) == expected
    for size in (1, 2, 3, 5, 100):
        cut = StopTextFilter(stops)
        sent = "".join(cut.feed(text[i : i + size]) for i in range(0, len(text), size)) + cut.finish()
        assert sent == expected
    partial = StopTextFilter(["END"])
    assert partial.feed("abcE") == "abc" and partial.feed("N") == "" and partial.feed("x") == "ENx" and partial.finish() == ""
    assert cut_at_stop("no stop here", ["zz"]) == "no stop here" and cut_at_stop("a(b", None) == "a(b"
