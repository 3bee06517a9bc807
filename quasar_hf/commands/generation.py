"""Timed generation for the CLI: Quasar speculative (any verifier) or plain `generate`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from quasar_hf import compat
from quasar_hf.detect import plain_decoding


@dataclass
class GenerationResult:
    """One timed generation: the new tokens' text and the numbers the CLI prints."""

    text: str
    new_tokens: int
    seconds: float
    mean_acceptance_length: float | None = None  # None for plain decoding

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def sampling_kwargs(max_new_tokens: int, temperature: float) -> dict:
    """Greedy at temperature 0, sampling otherwise (the options `generate` takes)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return {"max_new_tokens": max_new_tokens, "do_sample": False}
    return {"max_new_tokens": max_new_tokens, "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def run_generation(
    model: Any,
    tokenizer: Any,
    input_ids: torch.Tensor,  # [1, T]
    *,
    quasar: Any,  # None for plain generate, else a QuasarGenerationConfig
    max_new_tokens: int,
    temperature: float = 0.0,
    streamer: Any = None,
) -> GenerationResult:
    """Generate once and time it; Quasar runs go through `speculative_generate` (any verifier dtype)."""
    kwargs = sampling_kwargs(max_new_tokens, temperature)
    input_ids = input_ids.to(compat.input_device(model))
    attention_mask = torch.ones_like(input_ids)
    start = time.perf_counter()
    with torch.no_grad():
        if quasar is None:
            sequences = model.generate(
                input_ids, attention_mask=attention_mask, streamer=streamer, **plain_decoding(model), **kwargs
            )
            acceptance = None
        else:
            from quasar_hf.speculative import speculative_generate

            output = speculative_generate(
                model,
                input_ids,
                attention_mask,
                quasar_config=quasar,
                streamer=streamer,
                return_dict_in_generate=True,
                **kwargs,
            )
            sequences, acceptance = output.sequences, output.quasar_stats.mean_acceptance_length
    seconds = time.perf_counter() - start
    new = sequences[0, input_ids.shape[1] :]
    return GenerationResult(tokenizer.decode(new, skip_special_tokens=True), int(new.numel()), seconds, acceptance)


def describe(label: str, result: GenerationResult) -> str:
    """One line of numbers for a run."""
    line = f"{label}: {result.new_tokens} tokens in {result.seconds:.2f} s = {result.tokens_per_s:.1f} tokens/s"
    if result.mean_acceptance_length is not None:
        line += f", mean acceptance length L = {result.mean_acceptance_length:.2f}"
    return line
