"""drafter="auto": per step and per row, n-gram drafts, the model's own draft path, or none.

Two sources, each under its own `AdaptivePolicy` (draft length from its recent acceptance,
pauses when it does not pay against plain decoding): n-gram (prompt lookup: free, useful where
the output copies the input) and the model drafter (the self-draft path, when the model has one).
Each step the source with the higher expected speedup (an unmeasured source counts as best, so
it gets tried) drafts for every row it can serve; a row the preferred source cannot serve takes
the other source's draft, a row neither serves is a plain decode step. While the model drafter
is preferred, the n-gram drafts it displaced are scored against the tokens the verifier emits
(free, and exact for greedy), so the n-gram estimate stays current. Tokens are still decided by
the verifier alone.

Then, in a call of several prompts, the step gate (step_gate.py) prices the batch: one row's draft
widens every row's step, so it verifies the drafts at the width with the most expected tokens per
measured second, truncating longer drafts, or none (a plain step) when no width beats plain
decoding; drafts it withholds are scored like displaced ones. A single prompt's draft widens only
its own step, which its source's policy already prices (it sees a plain step whenever the row has
no draft), so there the gate stays out: it would only add its probe steps.

Sampling draws random numbers per drafted token, so there no decision depends on a clock (no
pauses, no gate, heuristic lengths): a seeded call then draws the same tokens on every run.

drafter_kwargs for "auto": model_drafter = registry name of the model drafter ("self_reduced",
"self", or "none"; default: the first of those the model supports), ngram = False to leave
n-gram drafts out (adaptive self-drafting alone), policy = dict of AdaptivePolicy options, gate =
False to verify every draft whole (or a dict of StepGate options).

Calibration informs the model drafter: its policy starts from the draft path's measured top-1
agreement and best draft length, and decides after one probe step (pausing 16 steps at first,
not 4, when calibration expects no gain). When calibration predicts less
than `MIN_PREDICTED_SPEEDUP` for the draft path even bytes-bound and the model drafter was not
named, auto leaves it out and drafts with n-grams alone (`summary()["model_left_out"]` says why).
N-gram drafts keep the full length and their pauses stay short (`NGRAM_POLICY`): they are free
to make and right in bursts, and copying resumes without warning.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from .adaptive import AdaptivePolicy, empty_draft
from .drafters import DRAFTER_FACTORIES, Draft, Drafter, DraftSetup, NgramDrafter
from .step_gate import StepGate

MODEL_DRAFTER_PREFERENCE = ("self_reduced", "self")
# N-gram drafts cost nothing to make, only their verification, and they are right in bursts (the
# output copies a span, or not at all), which a per-token acceptance rate does not describe:
# shortening them after a rejection (Transformers' heuristic) or by the geometric cost model
# both measured slower than always drafting the full length. So n-gram drafts keep the full
# length, and pauses stay short: a long pause would miss the start of the next copied span.
NGRAM_POLICY = {"max_pause_steps": 4}  # min_tokens = max_tokens: see AutoDrafter.__init__


class AutoDrafter:
    """Combine an n-gram drafter and an optional model drafter, each under its own adaptive policy."""

    def __init__(
        self,
        ngram: NgramDrafter | None,
        model_drafter: Drafter | None,
        num_draft_tokens: int = 5,
        policy: dict | None = None,
        clock: Callable[[], float] = time.perf_counter,
        gate: StepGate | None = None,
    ) -> None:
        if ngram is None and model_drafter is None:
            raise ValueError("drafter='auto' needs at least one source: n-gram drafts or a model drafter.")
        options = dict(policy or {})
        options.setdefault("max_tokens", max(1, num_draft_tokens))
        self.ngram = ngram
        self.model_drafter = model_drafter
        ngram_options = NGRAM_POLICY | {"min_tokens": options["max_tokens"]} | options
        self.ngram_policy = AdaptivePolicy(**ngram_options)
        self.model_policy = AdaptivePolicy(**_with_prior(options, getattr(model_drafter, "calibration_prediction", None)))
        self.gate = gate if gate is not None else StepGate()  # how much of the batch's drafts a step verifies
        self.model_left_out: str | None = None  # why auto_factory left the model's draft path out
        self.clock = clock
        self.setup: DraftSetup | None = None
        self.device = torch.device("cpu")
        self._step: dict | None = None
        self.batched = True  # set by start: whether this call has several prompts (the step gate's case)
        self._shadows: dict[int, tuple[int, torch.Tensor, str]] = {}  # row -> (its length, draft not sent, source)
        self.steps_by_source = {"ngram": 0, "model": 0, "none": 0}  # row-steps, for stats and benchmarks
        self.tokens_by_source = {"ngram": 0, "model": 0}  # drafted tokens

    def start(self, prompts: list[torch.Tensor], setup: DraftSetup) -> None:
        self.setup, self.device = setup, setup.device
        self._shadows, self._step = {}, None  # rows of an earlier call (the serving engine keeps its drafter)
        self.batched = len(prompts) > 1  # one prompt's draft widens only its own step: its policy prices that
        self.gate.padded_width = setup.verify_width
        if setup.do_sample:  # no decision from a clock: a seeded call draws the same tokens every run
            self.gate.min_gain = 0.0
            for policy in (self.ngram_policy, self.model_policy):
                policy.min_gain, policy.length_rule = 0.0, "heuristic"
        if self.ngram is not None:
            self.ngram.start(prompts, setup)
        if self.model_drafter is not None:
            self.model_drafter.start(prompts, setup)

    def propose(self, sequences: list[torch.Tensor], max_tokens: list[int]) -> Draft:
        started = self.clock()
        batch = len(sequences)
        self._score_shadows(sequences)
        rows: list[torch.Tensor | None] = [None] * batch
        source = ["none"] * batch
        k_ngram = self.ngram_policy.draft_length() if self.ngram is not None else 0
        k_model = self.model_policy.draft_length() if self.model_drafter is not None else 0
        prefer_model = k_model > 0 and _gain(self.model_policy) > _gain(self.ngram_policy)
        found: list[torch.Tensor | None] = [None] * batch
        if k_ngram:
            for b, (seq, budget) in enumerate(zip(sequences, max_tokens)):
                lookup = self.ngram.lookup(seq, min(k_ngram, budget))
                if lookup.numel():
                    found[b] = lookup
                    if not prefer_model:
                        rows[b], source[b] = lookup, "ngram"
        ngram_end = self.clock()
        model_draft = None
        want_model = [rows[b] is None and max_tokens[b] > 0 for b in range(batch)]
        if k_model and any(want_model):
            budgets = [min(k_model, m) if w else 0 for m, w in zip(max_tokens, want_model)]
            model_draft = self.model_drafter.propose(sequences, budgets)
            for b in range(batch):
                n = int(model_draft.lengths[b])
                if want_model[b] and n:
                    rows[b], source[b] = model_draft.tokens[b, :n], "model"
        for b in range(batch):  # n-gram drafts not sent: scored against what the verifier emits instead
            if found[b] is not None and source[b] == "model":
                self._shadows.setdefault(b, (sequences[b].shape[0], found[b], "ngram"))
            elif found[b] is not None and source[b] == "none":
                rows[b], source[b] = found[b], "ngram"
        self._gate(sequences, rows, source, max_tokens)
        ended = self.clock()
        for s, r in zip(source, rows):
            self.steps_by_source[s] += 1
            if r is not None:
                self.tokens_by_source[s] += r.numel()
        draft = self._combine(rows, source, model_draft)
        self._step = {
            "source": source,
            "lengths": draft.lengths.tolist(),
            "ngram_s": ngram_end - started,
            "model_s": ended - ngram_end,
            "model_called": model_draft is not None,
            "end": ended,
        }
        return draft

    def _gate(
        self, sequences: list[torch.Tensor], rows: list[torch.Tensor | None], source: list[str], budgets: list[int]
    ) -> None:
        """Cut every draft to the width the step gate picks (step_gate.py); drafts withheld whole are scored
        against the tokens the verifier emits instead, so their source's acceptance stays current."""
        if not self.batched:
            return
        lengths = [0 if r is None else r.numel() for r in rows]
        width = self.gate.width(lengths, source, budgets)
        for b, n in enumerate(lengths):
            if n > width and width > 0:
                rows[b] = rows[b][:width]
            elif n > width:
                self._shadows.setdefault(b, (sequences[b].shape[0], rows[b], source[b]))
                rows[b], source[b] = None, "none"

    def _combine(self, rows: list[torch.Tensor | None], source: list[str], model_draft: Draft | None) -> Draft:
        """Right-padded tokens; probabilities (sampling only) = the model's q, one-hot for n-gram rows."""
        batch = len(rows)
        k = max((r.numel() for r in rows if r is not None), default=0)
        if k == 0:
            return empty_draft(batch, self.device)
        tokens = torch.zeros(batch, k, dtype=torch.long, device=self.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        for b, r in enumerate(rows):
            if r is not None:
                tokens[b, : r.numel()] = r
                lengths[b] = r.numel()
        probs = None
        if model_draft is not None and model_draft.probs is not None and "model" in source:
            vocab = model_draft.probs.shape[-1]
            probs = torch.zeros(batch, k, vocab, dtype=model_draft.probs.dtype, device=self.device)
            for b, s in enumerate(source):
                n = int(lengths[b])
                if s == "model":
                    probs[b, :n] = model_draft.probs[b, :n]
                elif s == "ngram":
                    probs[b, torch.arange(n), tokens[b, :n]] = 1.0  # deterministic draft: q is one-hot
        return Draft(tokens=tokens, lengths=lengths, probs=probs)

    def on_accept(self, num_accepted: torch.Tensor) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        verify_s = self.clock() - step["end"]
        accepted = num_accepted.tolist()
        source, lengths = step["source"], step["lengths"]
        self.gate.record(len(source), max(lengths, default=0), verify_s)
        if step["model_called"]:
            # Rows that used n-gram drafts (or none) accept none of the model's own drafts: roll them all back.
            from_model = torch.tensor([s == "model" for s in source], device=num_accepted.device)
            self.model_drafter.on_accept(torch.where(from_model, num_accepted, torch.zeros_like(num_accepted)))
        for name, policy, seconds in (
            ("ngram", self.ngram_policy, step["ngram_s"]),
            ("model", self.model_policy, step["model_s"]),
        ):
            picked = [b for b, s in enumerate(source) if s == name]
            if picked:
                self.gate.observe(name, [lengths[b] for b in picked], [accepted[b] for b in picked])
                policy.record([lengths[b] for b in picked], [accepted[b] for b in picked], seconds, verify_s)
            elif all(s == "none" for s in source):
                policy.record([0] * len(source), [0] * len(source), 0.0, verify_s)  # a plain step: its cost is the baseline
            else:
                policy.skip_step()  # the other source drafted: a pause still runs down

    def _score_shadows(self, sequences: list[torch.Tensor]) -> None:
        """Acceptance the unsent drafts would have had, scored against the tokens emitted since: keeps each
        source's estimate current while the other is preferred or the step gate withholds it. A draft is
        scored once it is decided (a token disagrees, or all of it was emitted), as if verified. Exact for greedy."""
        shadows, self._shadows = self._shadows, {}
        scored: dict[str, tuple[list[int], list[int]]] = {"ngram": ([], []), "model": ([], [])}
        for b, (length, tokens, name) in shadows.items():
            emitted = sequences[b][length : length + tokens.numel()]
            agree = int((emitted == tokens[: emitted.numel()]).long().cumprod(0).sum())
            if agree == emitted.numel() < tokens.numel():  # every token so far agrees: the rest is not known yet
                self._shadows[b] = (length, tokens, name)
                continue
            scored[name][0].append(tokens.numel())
            scored[name][1].append(agree)
        for name, policy in (("ngram", self.ngram_policy), ("model", self.model_policy)):
            if scored[name][0]:
                policy.observe_acceptance(*scored[name])
                self.gate.observe(name, *scored[name])

    def select_rows(self, rows: torch.Tensor) -> None:
        kept = rows.tolist()
        self._shadows = {new: self._shadows[old] for new, old in enumerate(kept) if old in self._shadows}
        if self.ngram is not None:
            self.ngram.select_rows(rows)
        if self.model_drafter is not None:
            self.model_drafter.select_rows(rows)

    def add_rows(self, prompts: list[torch.Tensor]) -> None:
        """Rows that joined the batch: the step gate prices the batch from now on."""
        self.batched = True
        for source in (self.ngram, self.model_drafter):
            if source is not None:
                source.add_rows(prompts)

    def summary(self) -> dict:
        """Which source drafted how often, and each policy's estimates."""
        return {
            "model_left_out": self.model_left_out,
            "steps_by_source": dict(self.steps_by_source),
            "tokens_by_source": dict(self.tokens_by_source),
            "ngram": self.ngram_policy.to_dict(),
            "model": self.model_policy.to_dict(),
            "gate": self.gate.to_dict(),
        }


PRIOR_WEIGHT = 4.0  # the calibration agreement counts as this many observed draft tokens
# A bytes-bound prediction is an upper bound: a draft forward also pays per-call costs (norms,
# rotary, kernel launches), which made SmolLM2-135M's draft token cost 1.4x its share of bytes on
# CPU. Below this predicted speedup, auto does not try the draft path unless it is named.
MIN_PREDICTED_SPEEDUP = 1.1
LONG_PAUSE_STEPS = 16


def _with_prior(options: dict, prior: dict | None) -> dict:
    """Policy options for the model drafter: start from what calibration measured (its agreement as
    the acceptance prior, its best draft length, a decision after one probe step) unless the caller
    set those options."""
    if not prior:
        return options
    informed = {
        "prior_acceptance": min(max(prior["acceptance"], 0.0), 0.999),
        "prior_weight": PRIOR_WEIGHT,
        "initial_tokens": min(prior["draft_tokens"], options["max_tokens"]),
        "warmup_steps": 1,
    }
    if prior["predicted_speedup"] < MIN_PREDICTED_SPEEDUP and not {"pause_steps", "max_pause_steps"} & set(options):
        # calibration expects no gain: probe rarely (each probe after a pause also pays the draft
        # model's catch-up on the tokens it missed)
        informed |= {"pause_steps": LONG_PAUSE_STEPS, "max_pause_steps": 16 * LONG_PAUSE_STEPS}
    return informed | options


def _gain(policy: AdaptivePolicy) -> float:
    """Expected speedup of a source at its current length; +inf while unmeasured (so it gets tried)."""
    gain = policy.expected_gain(max(1, policy.draft_length()))
    return float("inf") if gain is None else gain


def _model_drafter(verifier: torch.nn.Module, config, name: str | None) -> Drafter | None:
    """The named model drafter, or the first the model supports (None: the model has no draft path)."""
    if name == "none":
        return None
    names = [name] if name else [n for n in MODEL_DRAFTER_PREFERENCE if n in DRAFTER_FACTORIES]
    sub_config = dataclasses.replace(config, drafter="ngram", drafter_kwargs={})
    for candidate in names:
        factory = DRAFTER_FACTORIES.get(candidate)
        if factory is None:
            raise ValueError(f"drafter='auto': unknown model drafter {candidate!r}; available: {sorted(DRAFTER_FACTORIES)}.")
        try:
            return factory(verifier, dataclasses.replace(sub_config, drafter=candidate))
        except ValueError:
            if name:  # asked for explicitly: the user should see why it is unavailable
                raise
    return None


def _step_gate(kwargs: dict) -> StepGate:
    """drafter_kwargs "gate": True (default), False (every draft verified whole), or a dict of StepGate options."""
    option = kwargs.get("gate", True)
    if option is True:
        return StepGate()
    if option is False:
        return StepGate(min_gain=0.0)
    if isinstance(option, dict):
        unknown = sorted(set(option) - {"min_gain", "decay"})
        if unknown:
            raise ValueError(f"drafter_kwargs['gate'] got unknown options {unknown}; valid: min_gain, decay.")
        return StepGate(**option)
    raise ValueError(f"drafter_kwargs['gate'] must be True, False or a dict of min_gain/decay, got {option!r}.")


def auto_factory(verifier: torch.nn.Module, config) -> Drafter:
    """Registry entry for drafter="auto" (see the module docstring for drafter_kwargs)."""
    kwargs = dict(config.drafter_kwargs)
    unknown = sorted(set(kwargs) - {"model_drafter", "ngram", "policy", "gate"})
    if unknown:
        raise ValueError(f"drafter='auto' got unknown drafter_kwargs {unknown}; valid: model_drafter, ngram, policy, gate.")
    if config.num_draft_tokens == 0:  # plain decoding through the loop: nothing drafts
        return NgramDrafter(0, config.max_ngram_size, config.min_ngram_size)
    use_ngram = kwargs.get("ngram", True)
    ngram = NgramDrafter(config.num_draft_tokens, config.max_ngram_size, config.min_ngram_size) if use_ngram else None
    model_drafter = _model_drafter(verifier, config, kwargs.get("model_drafter"))
    prior = getattr(model_drafter, "calibration_prediction", None)
    left_out = None
    if ngram is not None and kwargs.get("model_drafter") is None and prior and prior["predicted_speedup"] < MIN_PREDICTED_SPEEDUP:
        # bytes-bound (no per-call overhead) the draft path would barely pay: probing it only costs
        left_out = (
            f"calibration predicts {prior['predicted_speedup']}x for the draft path (top-1 agreement {prior['acceptance']})"
        )
        model_drafter = None
    drafter = AutoDrafter(ngram, model_drafter, config.num_draft_tokens, kwargs.get("policy"), gate=_step_gate(kwargs))
    drafter.model_left_out = left_out
    return drafter


DRAFTER_FACTORIES.setdefault("auto", auto_factory)
