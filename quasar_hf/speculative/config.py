"""QuasarGenerationConfig: how Quasar speculative generation drafts and verifies."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_DRAFTER = "auto"  # n-gram drafts (the Quasar authors' drafter) under the step gate, plus the draft path where it pays
DEFAULT_NUM_DRAFT_TOKENS = 5  # the Quasar authors' setting (n-gram drafter, 5 speculative tokens)
DRAFTER_METHODS = ("start", "propose", "on_accept", "select_rows")  # the Drafter interface (drafters.py)
CACHE_IMPLEMENTATIONS = ("dynamic", "static")
RENAMED_OPTIONS = {"shape_stable_attention": "rowstable_attention"}  # old name -> the option to use


@dataclass
class QuasarGenerationConfig:
    """Settings of the speculative loop (everything else comes from the GenerationConfig).

    drafter: registry name ("auto", "ngram", "assistant", "self", "self_reduced") or a ready Drafter
        object. "auto" (default): n-gram drafts, and the model's draft path where calibration predicts
        it pays, each paused while it does not, verified at the width the step gate picks from measured
        step costs (speculative/step_gate.py); "ngram": every n-gram draft verified whole.
    num_draft_tokens: tokens proposed per verify step (upper bound; the loop never drafts past
        max_new_tokens).
    max_ngram_size / min_ngram_size: n-gram sizes tried by the prompt-lookup drafter, longest first.
    assistant_model: the causal LM drafting for drafter="assistant" (must share the tokenizer).
    drafter_kwargs: extra keyword arguments for the drafter factory.
    rowstable_attention: True (default) makes every verified row's attention equal to the decode
        step's, so the KV cache and logits are bit-identical to plain decoding (greedy output equals
        plain greedy token for token). Quasar models get this from their row-stable attention
        kernel (C on CPU, Triton on CUDA: one batched call); where no kernel applies (float16 on CPU,
        or an SDPA model) verification runs one SDPA call per query row instead.
        False runs one batched call per layer whatever the attention: with SDPA that is faster,
        but its rounding then differs from decode steps, which W8A8 rounding can amplify into
        different tokens.
    cache_implementation: "dynamic" (default: grows with the text, any batch size) or "static"
        (allocated once for max_length + num_draft_tokens + 1 tokens; rollback moves a length;
        drafts are padded to num_draft_tokens so every step has one of two shapes; finished rows of a
        batch idle in it, so its size never changes).
    compile: False (default), True, or a transformers.CompileConfig. True compiles the decode and
        verify steps with `model.get_compiled_call` (fullgraph, static shapes; CUDA graphs on CUDA,
        Inductor's C++ code on CPU) over a static cache. Greedy output then equals plain greedy
        decoding with the same compiled step (`num_draft_tokens=0`), token for token; it need not
        equal eager decoding. Batch sizes round up to a power of two, and every call of up to 4096
        tokens (prompt + new) shares one cache size; each such shape compiles its two graphs on first
        use, or beforehand with `quasar_hf.warm_up(model, batch_sizes=...)`, which also keeps them in
        an on-disk cache for the next process; a model keeps the 32 most recently used shapes
        (speculative/compiled_steps.py).
    """

    drafter: Any = DEFAULT_DRAFTER
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    max_ngram_size: int = 3
    min_ngram_size: int = 1
    assistant_model: Any = None
    drafter_kwargs: dict = field(default_factory=dict)
    rowstable_attention: bool = True
    cache_implementation: str = "dynamic"
    compile: Any = False

    def __post_init__(self) -> None:
        if not isinstance(self.num_draft_tokens, int) or self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be an int >= 0, got {self.num_draft_tokens!r} (5 is the Quasar default).")
        if not (1 <= self.min_ngram_size <= self.max_ngram_size):
            raise ValueError(
                "n-gram sizes must satisfy 1 <= min_ngram_size <= max_ngram_size, got "
                f"min_ngram_size={self.min_ngram_size}, max_ngram_size={self.max_ngram_size}."
            )
        if self.cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"cache_implementation must be one of {list(CACHE_IMPLEMENTATIONS)}, got {self.cache_implementation!r}."
            )
        if not isinstance(self.compile, bool) and type(self.compile).__name__ != "CompileConfig":
            raise TypeError(f"compile takes True, False or a transformers.CompileConfig, got {self.compile!r}.")
        if self.compile:
            self.cache_implementation = "static"  # compiled steps need fixed shapes and cache addresses
        if self.assistant_model is not None and self.drafter in (DEFAULT_DRAFTER, "ngram"):
            self.drafter = "assistant"
        _check_drafter(self.drafter)

    @classmethod
    def from_value(cls, value: Any) -> QuasarGenerationConfig:
        """Accept True | dict | QuasarGenerationConfig (the forms `generate(quasar=...)` takes)."""
        if isinstance(value, QuasarGenerationConfig):
            return value
        if value is True:
            return cls()
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                renamed = "".join(f" Use {RENAMED_OPTIONS[name]!r} for {name!r}." for name in unknown if name in RENAMED_OPTIONS)
                raise ValueError(f"Unknown quasar option(s) {unknown}; valid options are {sorted(known)}.{renamed}")
            return cls(**value)
        raise TypeError(f"quasar= takes True, a dict or a QuasarGenerationConfig, got {type(value).__name__} ({value!r}).")

    def to_dict(self) -> dict:
        """Plain dict without the model object (for logs and benchmark records)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["assistant_model"] = None if self.assistant_model is None else type(self.assistant_model).__name__
        if not isinstance(self.drafter, str):
            data["drafter"] = type(self.drafter).__name__
        if not isinstance(self.compile, bool):
            data["compile"] = self.compile.to_dict()
        return data


def _check_drafter(drafter: Any) -> None:
    """A registry name, or an object with the Drafter methods (a ValueError / TypeError saying which is wrong)."""
    from .drafters import DRAFTER_FACTORIES

    if isinstance(drafter, str):
        if drafter not in DRAFTER_FACTORIES:
            raise ValueError(f"Unknown drafter {drafter!r}; available: {sorted(DRAFTER_FACTORIES)}, or a Drafter object.")
        return
    expected = (
        f"a drafter name ({', '.join(sorted(DRAFTER_FACTORIES))}) or an object with the methods {', '.join(DRAFTER_METHODS)}"
    )
    if isinstance(drafter, type):
        raise TypeError(
            f"drafter must be {expected}; got the class {drafter.__name__}: pass an instance, {drafter.__name__}(...)."
        )
    missing = [name for name in DRAFTER_METHODS if not callable(getattr(drafter, name, None))]
    if missing:
        raise TypeError(f"drafter must be {expected}; got {type(drafter).__name__}, which lacks {', '.join(missing)}.")
