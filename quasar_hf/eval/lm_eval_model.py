"""The lm-eval model type "quasar-hf": lm-eval's HF model whose generation runs Quasar decoding.

`QuasarLM` is lm-eval's `HFLM` (loglikelihood, rolling loglikelihood, batching, chat templates:
all lm-eval's own code) with one change: on a Quasar W8A8 model, `generate_until` calls
`model.generate(..., quasar=...)`, i.e. n-gram drafts verified by the W8A8 model. Greedy output
is token for token the W8A8 model's own greedy output, so scores are those of plain decoding,
only faster. lm-eval's stop-sequence criterion keeps one flag per batch row and answers for the
whole batch, while the speculative loop asks about one row at a time; `RowStopSequences` is
the same rule (stop when a stop string appears in the decoded tail of the generated tokens)
answered per row, and is used on both paths so they stop at the same token.

Use it from Python (`QuasarLM(pretrained=model, tokenizer=tok)`) or, after `import
quasar_hf.eval.lm_eval_model`, by name: `lm_eval.simple_evaluate(model="quasar-hf", model_args=...)`.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from transformers import StoppingCriteriaList

from quasar_hf.detect import is_quasar_model

from .stopping import RowStopSequences

MODEL_NAME = "quasar-hf"


@register_model(MODEL_NAME)
class QuasarLM(HFLM):
    """lm-eval HFLM whose generation uses Quasar speculative decoding on Quasar models.

    `quasar`: True (n-gram drafts, the defaults of QuasarGenerationConfig), a dict /
    QuasarGenerationConfig, or False for plain `generate` (the reference path). On a model that is
    not a Quasar W8A8 model, generation is plain `generate` and `quasar_decoding` is False.
    """

    def __init__(self, pretrained: Any, quasar: bool | dict | Any = True, **kwargs: Any) -> None:
        import quasar_hf  # noqa: F401  (registers quant_method "quasar" so Quasar checkpoints load as W8A8)

        super().__init__(pretrained=pretrained, **kwargs)
        if isinstance(quasar, str):  # from an lm-eval model_args string: quasar=False
            quasar = quasar.strip().lower() not in ("false", "0", "no", "off")
        self.quasar = quasar
        self.quasar_decoding = bool(quasar) and is_quasar_model(self.model)
        self.quasar_stats: list[Any] = []  # one QuasarStats per speculative generate call

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any) -> torch.Tensor:
        """context [B, T] left-padded ids -> [B, T + new] like HFLM, stopping each row on its own."""
        generation_kwargs["temperature"] = generation_kwargs.get("temperature", 0.0)
        if generation_kwargs["temperature"] == 0.0 and generation_kwargs.get("do_sample") is None:
            generation_kwargs["do_sample"] = False
        if generation_kwargs.get("do_sample") is False and generation_kwargs["temperature"] == 0.0:
            generation_kwargs.pop("temperature")
        criteria = StoppingCriteriaList([RowStopSequences(stop, self.tokenizer, context.shape[1])])
        common = dict(
            input_ids=context,
            max_length=max_length,
            stopping_criteria=criteria,
            pad_token_id=self.tokenizer.pad_token_id,
            **generation_kwargs,
        )
        if not self.quasar_decoding:
            return self.model.generate(use_cache=True, **common)
        out = self.model.generate(quasar=self.quasar, return_dict_in_generate=True, **common)
        self.quasar_stats.append(out.quasar_stats)
        return out.sequences


def mean_acceptance_length(stats: list[Any]) -> float | None:
    """Tokens per verify step over several generate calls (the paper's L), None without any step."""
    steps = sum(s.verify_steps for s in stats)
    return sum(s.new_tokens for s in stats) / steps if steps else None
