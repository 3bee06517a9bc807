"""What a generate call may do with Quasar, option by option, in one table (speculative/call_rules.py).

Each row is one generate argument, generation option or model input, and says what plain generate does with it
(runs, or fails: its own error), what `quasar=True` does (runs, or refuses with a message naming the option and
the fix) and what a call without `quasar=` does on a Quasar checkpoint whose generation config says `quasar: true`:
runs Quasar, decodes plainly (the reason logged once, plain generate's tokens), or raises. Checked on a tiny
Quasar checkpoint; greedy rows that run both ways give plain generate's tokens. Rows made of generation options
alone are also asked of the serving scheduler (request_config.request_quasar_config)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.streamers import BaseStreamer

from quasar_hf import compat
from quasar_hf.speculative.call_rules import check_call, generate_arguments
from quasar_hf.speculative.defaults import log_declined
from quasar_hf.speculative.request_config import request_quasar_config
from tests.helpers.hub import byte_level_tokenizer, make_tiny_checkpoint, quantize_tiny

IDS = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
RUNS = "runs"
QUASAR, PLAIN = "decodes with Quasar", "decodes plainly"  # what a call without quasar= does
FAILS = "(?s).*"  # plain generate raises its own error (any message: Transformers' or torch's words)
BASE = {"max_new_tokens": 4, "do_sample": False, "return_dict_in_generate": True}


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    call: Callable[[Any], tuple[tuple, dict]]  # env -> (args, kwargs) of the generate call, made fresh for each call
    plain: str  # RUNS, or a regex of plain generate's error (FAILS: any)
    quasar: str  # RUNS, or a regex of quasar=True's error
    default: str = ""  # QUASAR, PLAIN or an error's regex; "": QUASAR where quasar=True runs, else PLAIN
    declined: str = ""  # the reason a default logs, where it is not quasar=True's refusal
    model_generation: dict = dataclasses.field(default_factory=dict)  # model.generation_config fields for the call
    exact: bool = True  # greedy: quasar=True's tokens are plain generate's

    def expected_default(self) -> str:
        return self.default or (QUASAR if self.quasar == RUNS else PLAIN)


class ids:  # noqa: N801 - reads as a call in the table: ids(num_beams=2)
    """A call of the prompt IDS and these keyword arguments."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def __call__(self, env: Any) -> tuple[tuple, dict]:
        return (IDS,), self.kwargs


def filled_cache(env: Any) -> DynamicCache:
    """An earlier turn's cache: the keys and values of IDS but its last 4 tokens."""
    cache = DynamicCache(config=env.model.config)
    with torch.no_grad():
        env.model(IDS[:, :-4], use_cache=True, **{compat.cache_argument_name(env.model): cache})
    return cache


class NoSevens(LogitsProcessor):
    def __call__(self, input_ids, scores):
        scores[:, 7] = -float("inf")
        return scores


class Recorder(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


BATCH = torch.stack([IDS[0], torch.tensor([9, 8, 7, 6, 5, 9, 8, 7, 6, 5, 9, 8])])
LEFT, RIGHT, EMPTY_ROW = (torch.ones_like(BATCH) for _ in range(3))
LEFT[1, :3], RIGHT[1, -3:], EMPTY_ROW[1] = 0, 0, 0

OPTIONS = [
    # generate's own arguments
    Option("positional generation_config", lambda env: ((IDS, GenerationConfig(num_beams=2, **BASE)), {}), RUNS, "beam search"),
    Option("prefix_allowed_tokens_fn", ids(prefix_allowed_tokens_fn=lambda b, s: list(range(200))), RUNS, r"prefix_allowed_tokens_fn= \(constrained decoding\); remove it"),
    Option("negative_prompt_ids", ids(negative_prompt_ids=IDS), RUNS, r"negative_prompt_ids= .*call generate without quasar="),
    Option("negative_prompt_attention_mask", ids(negative_prompt_attention_mask=torch.ones_like(IDS)), RUNS, "negative_prompt_attention_mask="),
    Option("custom_generate", ids(custom_generate=lambda model, input_ids, **kwargs: input_ids), RUNS, r"custom_generate= \(another decoding method\)"),
    Option("synced_gpus", ids(synced_gpus=True), FAILS, r"synced_gpus=True \(multi-GPU lockstep decoding\)", default=FAILS),
    Option("assistant_model", lambda env: ((IDS,), {"assistant_model": env.assistant}), RUNS, RUNS),
    Option("assistant_tokenizer", lambda env: ((IDS,), {"assistant_tokenizer": env.tokenizer}), RUNS, "assistant_tokenizer= .*share the model's tokenizer"),
    Option("streamer", ids(streamer=Recorder()), RUNS, RUNS),
    Option("logits_processor", ids(logits_processor=LogitsProcessorList([NoSevens()])), RUNS, RUNS),
    Option("stopping_criteria", lambda env: ((IDS,), {"stopping_criteria": StoppingCriteriaList([StopStringCriteria(env.tokenizer, ["\x05"])])}), RUNS, RUNS),
    Option("stop_strings + tokenizer", lambda env: ((IDS,), {"stop_strings": ["\x05"], "tokenizer": env.tokenizer}), RUNS, RUNS),
    Option("stop_strings without tokenizer", ids(stop_strings=["\x05"]), "tokenizer", "stop_strings needs the model's tokenizer: pass tokenizer=", default="stop_strings needs the model's tokenizer"),
    Option("model.generation_config.stop_strings", lambda env: ((IDS,), {"tokenizer": env.tokenizer}), RUNS, "model.generation_config.stop_strings is set; .* pass stop_strings=", model_generation={"stop_strings": ["\x05"]}),
    # generation options
    Option("sampling", ids(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01), RUNS, RUNS, exact=False),
    Option("penalties and bans", ids(repetition_penalty=1.3, no_repeat_ngram_size=2, bad_words_ids=[[7]], min_new_tokens=3), RUNS, RUNS),
    Option("eos, max_length, max_time", ids(eos_token_id=[8, 9], max_new_tokens=None, max_length=16, max_time=30.0), RUNS, RUNS),
    Option("return_dict_in_generate=False", ids(return_dict_in_generate=False), RUNS, RUNS),
    Option("num_beams", ids(num_beams=2), RUNS, r"beam search \(num_beams=2\); remove it"),
    Option("num_return_sequences", ids(num_return_sequences=2, do_sample=True), RUNS, "several returned sequences per prompt"),
    Option("penalty_alpha", ids(penalty_alpha=0.6, top_k=4), "trust_remote_code", r"contrastive search \(penalty_alpha=0.6\)", default="trust_remote_code"),
    Option("dola_layers", ids(dola_layers="low"), "trust_remote_code", "DoLa decoding", default="trust_remote_code"),
    Option("prompt_lookup_num_tokens", ids(prompt_lookup_num_tokens=3), RUNS, "prompt lookup .*drafter='ngram'"),
    Option("assistant_early_exit", ids(assistant_early_exit=1), RUNS, "self-speculative early exit"),
    Option("output_scores", ids(output_scores=True), RUNS, r"output_scores \(output_scores=True\)"),
    Option("output_logits", ids(output_logits=True), RUNS, "output_logits"),
    Option("output_attentions", ids(output_attentions=True), RUNS, "output_attentions"),
    Option("output_hidden_states", ids(output_hidden_states=True), RUNS, "output_hidden_states"),
    Option("prefill_chunk_size", ids(prefill_chunk_size=4), RUNS, "chunked prefill"),
    # plain generate's token healing fails with the tiny byte-level tokenizer (no vocabulary prefixes)
    Option("token_healing", lambda env: ((IDS,), {"token_healing": True, "tokenizer": env.tokenizer}), FAILS, "token healing", default=FAILS),
    Option("cache_implementation='sliding_window'", ids(cache_implementation="sliding_window"), RUNS, "use 'dynamic' or 'static'"),
    Option("cache_implementation='static'", ids(cache_implementation="static"), RUNS, RUNS),
    Option("cache_implementation='dynamic'", ids(cache_implementation="dynamic"), RUNS, RUNS),
    Option("guidance_scale", ids(guidance_scale=1.5), RUNS, r"classifier-free guidance \(guidance_scale=1.5\)"),
    Option("use_cache=False", ids(use_cache=False), RUNS, "needs use_cache=True"),
    # the prompt and other model inputs
    Option("attention_mask", ids(attention_mask=torch.ones_like(IDS)), RUNS, RUNS),
    Option("int32 input_ids", lambda env: ((IDS.int(),), {}), RUNS, RUNS),
    Option("left-padded batch", lambda env: ((BATCH,), {"attention_mask": LEFT}), RUNS, RUNS),
    Option("right-padded batch", lambda env: ((BATCH,), {"attention_mask": RIGHT}), RUNS, r"Right padding detected: .*padding_side = 'left'"),
    Option("an empty row", lambda env: ((BATCH,), {"attention_mask": EMPTY_ROW}), RUNS, r"Row\(s\) \[1\] of the batch are empty"),
    Option("no prompt (bos_token_id)", lambda env: ((), {"bos_token_id": 5}), RUNS, RUNS),
    Option("inputs_embeds", lambda env: ((), {"inputs_embeds": env.model.get_input_embeddings()(IDS).detach()}), RUNS, "needs the prompt as input_ids; inputs_embeds is not supported"),
    Option("position_ids", ids(position_ids=torch.arange(IDS.shape[1])[None]), RUNS, r"does not accept the model inputs \['position_ids'\]; pass input_ids and attention_mask only"),
    Option("token_type_ids", ids(token_type_ids=torch.zeros_like(IDS)), "not used by the model", r"model inputs \['token_type_ids'\]", default="not used by the model"),
    Option("filled DynamicCache", lambda env: ((IDS,), {compat.cache_argument_name(env.model): filled_cache(env)}), RUNS, RUNS, default=PLAIN, declined="a KV cache passed as .*fills it in place"),
    Option("StaticCache", lambda env: ((IDS,), {compat.cache_argument_name(env.model): StaticCache(config=env.model.config, max_cache_len=64)}), RUNS, "cannot use the StaticCache passed as", declined="a KV cache passed as cache"),
    Option("attention_mask of another shape", ids(attention_mask=torch.ones(1, 5, dtype=torch.long)), FAILS, r"attention_mask shape \(1, 5\) must equal input_ids shape \(1, 12\)", default="must equal input_ids shape"),
    Option("float input_ids", lambda env: ((IDS.float(),), {}), FAILS, r"must be a LongTensor of shape \[batch, prompt_length\]", default="must be a LongTensor"),
    Option("1-D input_ids", lambda env: ((IDS[0],), {}), FAILS, "must be a LongTensor", default="must be a LongTensor"),
    Option("empty prompt", lambda env: ((IDS[:, :0],), {}), FAILS, "input_ids is empty", default="input_ids is empty"),
    Option("id outside the vocabulary", lambda env: ((IDS + 1000,), {}), FAILS, r"token id 1009 \(row 0, position 4\), outside this model's vocabulary", default="outside this model's vocabulary"),
]  # fmt: skip


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = make_tiny_checkpoint(tmp_path_factory.mktemp("base"))
    folder = tmp_path_factory.mktemp("quasar")
    quantize_tiny(base).save_pretrained(folder)
    assert json.loads((folder / "generation_config.json").read_text())["quasar"] is True
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assistant = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return SimpleNamespace(model=model, assistant=assistant, tokenizer=byte_level_tokenizer())


@contextlib.contextmanager
def model_generation(env: Any, option: Option) -> Iterator[None]:
    """The model's generation config with the row's fields set (a checkpoint that ships them)."""
    saved = {name: getattr(env.model.generation_config, name) for name in option.model_generation}
    try:
        for name, value in option.model_generation.items():
            setattr(env.model.generation_config, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(env.model.generation_config, name, value)


def call_of(env: Any, option: Option) -> tuple[tuple, dict]:
    args, kwargs = option.call(env)
    return args, kwargs if any(isinstance(a, GenerationConfig) for a in args) else {**BASE, **kwargs}


@pytest.fixture(autouse=True)
def fresh_decline_log():
    """log_declined logs each reason once per process: each test here starts and leaves it empty."""
    log_declined.cache_clear()
    yield
    log_declined.cache_clear()


def generate(env: Any, option: Option, **quasar: Any) -> Any:
    args, kwargs = call_of(env, option)
    torch.manual_seed(0)
    with model_generation(env, option):
        return env.model.generate(*args, **kwargs, **quasar)


def outcome(env: Any, option: Option, expected: str, **quasar: Any) -> Any:
    """The call's output where `expected` is RUNS (or QUASAR / PLAIN), else its error matched against `expected`."""
    if expected in (RUNS, QUASAR, PLAIN):
        return generate(env, option, **quasar)
    with pytest.raises(Exception) as raised:  # noqa: PT011 - which error is the row's regex
        generate(env, option, **quasar)
    assert re.search(expected, str(raised.value)), f"{option.name}: {raised.value!r} does not say {expected!r}"
    return None


def sequences(out: Any) -> torch.Tensor:
    return getattr(out, "sequences", out)


def ran_quasar(out: Any) -> bool:
    return getattr(out, "quasar_stats", None) is not None


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_each_option_as_plain_generate_and_quasar_take_it(env, option, caplog):
    plain = outcome(env, option, option.plain, quasar=False)
    assert plain is None or not ran_quasar(plain)
    explicit = outcome(env, option, option.quasar, quasar=True)
    if explicit is not None:
        assert ran_quasar(explicit) or isinstance(explicit, torch.Tensor)  # a tensor: return_dict_in_generate=False
        if option.exact:
            assert torch.equal(sequences(explicit), sequences(plain)), option.name
    expected = option.expected_default()
    log_declined.cache_clear()  # the quasar=False and quasar=True calls above may have reached a default (early exit)
    with caplog.at_level(logging.INFO, logger="quasar_hf.speculative.defaults"):
        default = outcome(env, option, expected)
        again = outcome(env, option, expected)
    declined = [r.getMessage() for r in caplog.records if "plain decoding instead of the default Quasar" in r.getMessage()]
    if expected == QUASAR:
        assert not declined and (ran_quasar(default) or isinstance(default, torch.Tensor))
    elif expected == PLAIN:
        # once per reason: assistant_early_exit's plain decoding calls the model's generate again, declined too
        assert len([m for m in declined if re.search(option.declined or option.quasar, m)]) == 1, declined
        assert not ran_quasar(default) and not ran_quasar(again)
        assert torch.equal(sequences(default), sequences(plain)), option.name


def answer(env: Any, option: Option, **quasar: Any) -> str | None:
    """check_call's answer for the row: None, the reason, or the message of the fault it raises."""
    args, kwargs = call_of(env, option)
    with model_generation(env, option):
        try:
            return check_call(env.model, args, {**kwargs, **quasar})
        except (TypeError, ValueError) as fault:
            return str(fault)


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_check_call_answers_each_option_as_generate_does(env, option):
    """None where the call runs Quasar; else the refusal quasar=True raises, which is also the reason a default
    declines (or the fault both raise); a default's own reason where it has one (a KV cache passed in)."""
    explicit = answer(env, option, quasar=True)
    assert explicit is None if option.quasar == RUNS else re.search(option.quasar, explicit or ""), explicit
    default = answer(env, option)
    if option.expected_default() == QUASAR:
        assert default is None
    else:
        assert re.search(option.declined or option.quasar, default or ""), default


REQUEST_ROWS = [
    o
    for o in OPTIONS
    if isinstance(o.call, ids)
    and all(hasattr(GenerationConfig(), name) for name in o.call.kwargs)
    and o.expected_default() in (QUASAR, PLAIN)
]


@pytest.mark.parametrize("option", REQUEST_ROWS, ids=lambda o: o.name)
def test_the_serving_scheduler_declines_what_a_default_declines(env, option):
    """A request's generation options decode with the loop exactly where a default generate call would
    (request_config.request_quasar_config asks check_call)."""
    config = GenerationConfig(**{**BASE, **option.call.kwargs})
    settings = request_quasar_config(env.model, config, None, env.tokenizer)
    assert (settings is None) == (option.expected_default() == PLAIN)


def test_positional_arguments_bind_as_plain_generates_signature_orders_them():
    config = GenerationConfig(max_new_tokens=3)
    assert generate_arguments((IDS, config), {"quasar": True}) == {"inputs": IDS, "generation_config": config, "quasar": True}
    with pytest.raises(TypeError):
        generate_arguments((IDS,), {"inputs": IDS})


# What generate consumes, drops or refuses itself before it calls a custom_generate strategy, which never sees it:
# prefix_allowed_tokens_fn and negative prompts become logits processors; synced_gpus and assistant_tokenizer are
# withheld, and position_ids replaced by generate's own; an all-ones attention_mask is dropped whatever its shape;
# stop strings need the tokenizer generate withholds from a strategy, and generate fails on token_type_ids, 1-D ids
# and a second custom_generate itself.
UNSEEN_BY_THE_STRATEGY = {
    "prefix_allowed_tokens_fn",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "synced_gpus",
    "assistant_tokenizer",
    "stop_strings without tokenizer",
    "model.generation_config.stop_strings",
    "position_ids",
    "token_type_ids",
    "attention_mask of another shape",
    "1-D input_ids",
}


@pytest.mark.parametrize(
    "option", [o for o in OPTIONS if o.quasar != RUNS and o.name not in UNSEEN_BY_THE_STRATEGY], ids=lambda o: o.name
)
def test_the_custom_generate_strategy_refuses_as_quasar_true_does(env, option):
    """`custom_generate=quasar_hf.generate` asks the same rules (call_rules.check_prepared) of what generate hands it."""
    import quasar_hf

    args, kwargs = call_of(env, option)
    with model_generation(env, option), pytest.raises((TypeError, ValueError)) as raised:
        env.model.generate(*args, **kwargs, quasar=False, custom_generate=quasar_hf.generate)
    assert re.search(option.quasar, str(raised.value)), raised.value
