"""What a `generate` call may do with Quasar: one list of rules, which every caller asks.

`check_call(model, args, kwargs)` takes a generate call as written (`kwargs` hold `quasar=` when it was passed;
without it, and without `assistant_model=`, the call reads the checkpoint's default) and returns why the
speculative loop cannot run it, else None. Who asks:
  * `strategy.generate_with_quasar` (`generate(quasar=...)`, `speculative_generate`, hub/quasar-generate, the
    serving engine's rows) raises ValueError(reason);
  * a Quasar model's generate without `quasar=` (hf/binding.py) decodes plainly instead and logs the reason once
    (`defaults.log_declined`); so does the serving scheduler for a request (`request_config.request_quasar_config`).
`check_prepared` asks the same rules about what generate hands `custom_generate=quasar_hf.generate`.

The rules follow plain generate: a call it accepts, Quasar runs or declines with a reason that names the option
and the fix (a default then decodes plainly, with plain generate's result). A default also declines a KV cache
passed in: plain generate fills it in place, Quasar returns a cache of its own. A call that plain generate cannot
run either (a prompt that is not token ids, ids outside the vocabulary, stop strings without a tokenizer) raises
here, TypeError or ValueError naming the fault, whichever way Quasar was asked for.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from transformers import GenerationConfig, GenerationMixin

from quasar_hf import compat

NOT_SUPPORTED = "quasar speculative generation does not support"
PLAINLY = "remove it, or call generate without quasar= to decode plainly"
# generate() arguments the loop does not implement: refused, never ignored
REFUSED_ARGUMENTS = {
    "prefix_allowed_tokens_fn": "constrained decoding",
    "negative_prompt_ids": "classifier-free guidance's negative prompt",
    "negative_prompt_attention_mask": "classifier-free guidance's negative prompt",
    "custom_generate": "another decoding method",
    "assistant_tokenizer": "universal assisted decoding; an assistant_model must share the model's tokenizer",
}
# GenerationConfig options that change the decoding algorithm itself: (neutral value, what it is)
REFUSED_OPTIONS = {
    "num_beams": (1, "beam search"),
    "num_return_sequences": (1, "several returned sequences per prompt"),
    "penalty_alpha": (None, "contrastive search"),
    "dola_layers": (None, "DoLa decoding"),
    "prompt_lookup_num_tokens": (None, "Transformers' prompt lookup (use quasar drafter='ngram' instead)"),
    "assistant_early_exit": (None, "Transformers' self-speculative early exit"),
    "output_scores": (False, "output_scores"),
    "output_logits": (False, "output_logits"),
    "output_attentions": (False, "output_attentions"),
    "output_hidden_states": (False, "output_hidden_states"),
    "prefill_chunk_size": (None, "chunked prefill"),
    "token_healing": (False, "token healing"),
}
SUPPORTED_CACHES = (None, "dynamic", "static")  # "static": the loop's StaticVerifierCache
CACHE_NAMES = ("cache", "past_key_values")  # the KV cache argument: `cache` from Transformers 5.24
ACCEPTED_INPUTS = ("input_ids", "attention_mask", "inputs_embeds", *CACHE_NAMES)  # the rest: refused model inputs
PREPARED_INPUTS = ("position_ids", "logits_to_keep", "use_cache")  # what generate adds before it calls a strategy
# keyword arguments of generate (and of Quasar's generate) that are neither generation options nor model inputs
CALL_KEYWORDS = ("tokenizer", "assistant_tokenizer", "trust_remote_code", "quasar", "quasar_generator")
CALL_KEYWORDS += ("quasar_prefixes", "quasar_keep_row_cache", "quasar_admit")

INPUTS_EMBEDS_HELP = (
    "generate(quasar=...) drafts and verifies token ids, so it needs the prompt as input_ids; inputs_embeds is not "
    "supported. Pass input_ids, or call generate without quasar for a prompt given as embeddings."
)
_SHORT_INT_DTYPES = (torch.int32, torch.int16, torch.int8, torch.uint8)
_GENERATE = inspect.signature(GenerationMixin.generate)


@dataclasses.dataclass
class Call:
    """A generate call as the rules see it."""

    model: Any
    config: GenerationConfig  # what the call decodes with, merged as generate merges it
    inputs: dict  # model inputs: input_ids, attention_mask, inputs_embeds, a KV cache, anything else
    arguments: dict  # generate's other arguments by name: synced_gpus, tokenizer, prefix_allowed_tokens_fn, ...
    quasar: Any = True  # quasar= as passed; None: the checkpoint's default
    prepared: bool = False  # what generate hands a custom_generate strategy (its own position ids and caches)


def generate_arguments(args: tuple, kwargs: dict) -> dict:
    """A generate call's arguments by name, positional ones bound as plain generate's signature orders them
    (TypeError where it would not bind)."""
    bound = _GENERATE.bind(None, *args, **kwargs).arguments
    bound.pop("self")
    bound.update(bound.pop("kwargs", {}))
    return bound


def check_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> str | None:
    """Why the speculative loop cannot run `model.generate(*args, **kwargs)`, else None (module docstring)."""
    arguments = generate_arguments(args, kwargs)
    quasar = arguments.get("quasar")
    if quasar is None and arguments.get("assistant_model") is not None:
        quasar = True  # an assistant's drafts verified by the model: asked for explicitly
    named = {k: v for k, v in arguments.items() if k in _GENERATE.parameters or k in CALL_KEYWORDS}
    options = {k: v for k, v in arguments.items() if k not in named}
    config, inputs = compat.merged_generation_config(model, arguments.get("generation_config"), options)
    inputs = {k: v for k, v in inputs.items() if not hasattr(config, k)}  # output_attentions & co: options
    if arguments.get("inputs") is not None:
        inputs["input_ids"] = arguments["inputs"]
    return first_reason(Call(model, config, inputs, named, quasar))


def check_prepared(
    model: torch.nn.Module, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict, **arguments: Any
) -> str | None:
    """`check_call` for what generate hands a custom_generate strategy: the prompt, the merged config, the model
    inputs it prepared, and `arguments` (synced_gpus=, quasar=)."""
    quasar = arguments.get("quasar")
    inputs = {"input_ids": input_ids, **model_kwargs}
    return first_reason(Call(model, generation_config, inputs, arguments, True if quasar is None else quasar, True))


def first_reason(call: Call) -> str | None:
    """The first rule the call breaks: a fault raises (check_faults), the loop declining returns its reason."""
    if getattr(call.model.config, "is_encoder_decoder", False):
        return "Quasar speculative generation supports decoder-only causal LMs, not encoder-decoder models."
    check_faults(call)
    for rule in RULES:
        reason = rule(call)
        if reason is not None:
            return reason
    return None


def as_long_ids(input_ids: Any) -> Any:
    """Token ids in a narrower integer dtype (int32 from some tokenizers and ONNX pipelines) as int64, as
    plain generate takes them; anything else as it is (check_faults judges it)."""
    if isinstance(input_ids, torch.Tensor) and input_ids.dtype in _SHORT_INT_DTYPES:
        return input_ids.long()
    return input_ids


# ---------------------------------------------------------------- faults: plain generate fails on them too
def check_faults(call: Call) -> None:
    """Raise for a call that plain generate cannot run either, naming the fault and the fix."""
    input_ids, attention_mask = as_long_ids(call.inputs.get("input_ids")), call.inputs.get("attention_mask")
    if not call.prepared and call.config.stop_strings is not None and call.arguments.get("tokenizer") is None:
        raise ValueError("stop_strings needs the model's tokenizer: pass tokenizer=... to generate (as plain generate requires).")
    if input_ids is None or call.inputs.get("inputs_embeds") is not None:
        return  # a prompt as inputs_embeds (a rule declines it), or none: generate starts from bos_token_id
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise TypeError(
            "input_ids must be a LongTensor of shape [batch, prompt_length] (use tokenizer(..., return_tensors='pt'))."
        )
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: speculative generation needs a prompt of at least one token.")
    _check_token_range(call.model, input_ids)
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}."
        )


def _check_token_range(model: torch.nn.Module, input_ids: torch.Tensor) -> None:
    """Every id indexes the embedding table (else the embedding lookup fails deep inside the forward)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is None or input_ids.numel() == 0:
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= rows:
        bad = low if low < 0 else high
        where = (input_ids == bad).nonzero()[0].tolist()
        raise ValueError(
            f"input_ids holds token id {bad} (row {where[0]}, position {where[1]}), outside this model's vocabulary "
            f"of {rows} ids (0..{rows - 1}). Tokenize with the model's own tokenizer, and use an in-vocabulary "
            "pad_token_id for padding."
        )


# ---------------------------------------------------------------- rules: what plain generate runs and the loop does not
def refused_argument(call: Call) -> str | None:
    for name, what in REFUSED_ARGUMENTS.items():
        if call.arguments.get(name) is not None:
            return f"{NOT_SUPPORTED} {name}= ({what}); {PLAINLY}."
    if call.arguments.get("synced_gpus"):
        return f"{NOT_SUPPORTED} synced_gpus=True (multi-GPU lockstep decoding); {PLAINLY}."
    return None


def prompt_as_embeddings(call: Call) -> str | None:
    return INPUTS_EMBEDS_HELP if call.inputs.get("inputs_embeds") is not None else None


def refused_option(call: Call) -> str | None:
    config = call.config
    for name, (neutral, what) in REFUSED_OPTIONS.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral:
            return f"{NOT_SUPPORTED} {what} ({name}={value!r}); remove it."
    if config.cache_implementation not in SUPPORTED_CACHES:
        return (
            f"quasar speculative generation keeps a dynamic or a static KV cache of its own (it rolls back rejected "
            f"drafts); cache_implementation={config.cache_implementation!r} is not supported: use 'dynamic' or 'static'."
        )
    if config.guidance_scale not in (None, 1, 1.0):
        return f"{NOT_SUPPORTED} classifier-free guidance (guidance_scale={config.guidance_scale!r}); remove it."
    if config.use_cache is False:
        return "quasar speculative generation needs use_cache=True (the KV cache is rolled back on rejection)."
    return None


def stop_strings_of_the_model(call: Call) -> str | None:
    if getattr(call.model.generation_config, "stop_strings", None) is None:
        return None
    return (
        "model.generation_config.stop_strings is set; Quasar generation takes stop strings per call. Set "
        "model.generation_config.stop_strings = None and pass stop_strings=... and tokenizer=... to generate."
    )


def passed_cache(call: Call) -> str | None:
    """A KV cache passed in: the loop continues from a filled DynamicCache of one unpadded prompt (an earlier
    turn's), as plain generate does; any other cache is refused rather than dropped."""
    from transformers import DynamicCache

    for name in CACHE_NAMES:
        cache = call.inputs.get(name)
        if cache is None or (call.prepared and call.config.cache_implementation == "static"):
            continue  # none, or generate's own static cache (the loop sizes one with room for its drafts)
        if call.quasar is None:
            return f"a KV cache passed as {name}= (plain generate fills it in place; Quasar decoding keeps its own)"
        if not isinstance(cache, DynamicCache):
            return (
                f"Quasar generation keeps its own dynamic KV cache and cannot use the {type(cache).__name__} passed as "
                f"{name}=...; drop that argument (for a static cache pass cache_implementation='static' or "
                f"quasar={{'cache_implementation': 'static'}}: the loop sizes one with room for its drafts)."
            )
        length = cache.get_seq_length()
        if length == 0:
            continue
        problem = _unusable_cache(call, cache, length)
        if problem is not None:
            return f"Quasar generation continuing from a filled {name}=... {problem}; drop {name} or fix the call."
    return None


def _unusable_cache(call: Call, cache: Any, length: int) -> str | None:
    input_ids, attention_mask = call.inputs.get("input_ids"), call.inputs.get("attention_mask")
    if input_ids is None or input_ids.shape[0] != 1 or (attention_mask is not None and not bool(attention_mask.all())):
        return "works for one unpadded prompt at a time"
    if call.config.cache_implementation == "static":
        return (
            "works with the loop's own caches (dynamic, or quasar={'cache_implementation': 'static'} and compiled "
            "steps), not generate's static cache (cache_implementation='static')"
        )
    if not all(compat.is_full_attention_layer(layer) for layer in cache.layers):
        return "needs full-attention layers (this model has sliding-window layers)"
    if length >= input_ids.shape[1]:
        return f"holds {length} tokens but input_ids has {input_ids.shape[1]}: pass the whole conversation, longer than the cache"
    return None


def other_model_inputs(call: Call) -> str | None:
    accepted = ACCEPTED_INPUTS + (PREPARED_INPUTS if call.prepared else ())
    extra = sorted(k for k, v in call.inputs.items() if v is not None and k not in accepted)
    if extra:
        return f"quasar speculative generation does not accept the model inputs {extra}; pass input_ids and attention_mask only."
    return None


def padding(call: Call) -> str | None:
    """Rows hold their prompts at the right end (plain generate warns on right padding and decodes anyway)."""
    attention_mask = call.inputs.get("attention_mask")
    if attention_mask is None or call.inputs.get("input_ids") is None:
        return None
    empty_rows = (attention_mask == 0).all(dim=-1).nonzero().flatten().tolist()
    if empty_rows:
        return (
            f"Row(s) {empty_rows} of the batch are empty: their attention_mask is all zeros, so they hold no prompt "
            "token. Remove those prompts from the batch, or give each row at least one token."
        )
    if bool((attention_mask[:, -1] == 0).any()):
        return "Right padding detected: decoder-only generation needs left padding (tokenizer.padding_side = 'left')."
    return None


RULES = (refused_argument, prompt_as_embeddings, refused_option, stop_strings_of_the_model, passed_cache)
RULES += (other_model_inputs, padding)
