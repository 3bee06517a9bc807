"""Greedy speculative generation equals plain greedy generate, token for token (tiny fp32 models)."""

import pytest
import torch

from quasar_hf.hf import bind_quasar_methods
from quasar_hf.ops.rowstable_attention import QUASAR_ATTENTION
from quasar_hf.speculative import NgramDrafter, QuasarGenerationConfig, speculative_generate
from quasar_hf.speculative.left_padding import left_padded
from tests.helpers.prompts import repetitive_prompt
from tests.helpers.spec_models import ARCHS, tiny_verifier

# Both ways verification rows are made equal to decode steps: SDPA one row at a time, and the
# row-stable attention kernel that Quasar models get (quasar_hf.ops.rowstable_attention).
ATTENTIONS = ["sdpa", QUASAR_ATTENTION]


def drafter_configs(verifier):
    return {
        "ngram": QuasarGenerationConfig(drafter="ngram"),
        "assistant_other": QuasarGenerationConfig(drafter="assistant", assistant_model=tiny_verifier(seed=7)),
        "assistant_self": QuasarGenerationConfig(drafter="assistant", assistant_model=verifier),  # always accepted
    }


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("drafter", ["ngram", "assistant_other", "assistant_self"])
def test_greedy_equals_plain_generate(arch, drafter, attention):
    model = tiny_verifier(arch, attention=attention)
    quasar = drafter_configs(model)[drafter]
    for seed in range(2):
        prompt = repetitive_prompt(seed)
        plain = model.generate(prompt, max_new_tokens=32, do_sample=False)
        spec = speculative_generate(model, prompt, max_new_tokens=32, do_sample=False, quasar_config=quasar)
        assert torch.equal(spec, plain), f"{arch}/{drafter}/prompt {seed}"


@pytest.mark.parametrize(
    "arch,drafter", [("llama", "ngram"), ("llama", "assistant_other"), ("llama", "assistant_self"), ("qwen3", "ngram")]
)
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_batch_rows_equal_single_row_runs_and_plain_batched_generate(arch, drafter, attention):
    model = tiny_verifier(arch, attention=attention)
    quasar = drafter_configs(model)[drafter]
    prompts = [repetitive_prompt(s, length) for s, length in [(0, 24), (1, 10), (2, 16), (3, 6)]]
    ids, mask = left_padded(prompts)
    singles = [speculative_generate(model, p, max_new_tokens=28, do_sample=False, quasar_config=quasar) for p in prompts]
    # An eos that some rows hit early makes rows finish at different steps.
    eos = int(singles[1][0, prompts[1].shape[1] + 5])
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=28, do_sample=False, eos_token_id=eos)
    spec = speculative_generate(model, ids, mask, max_new_tokens=28, do_sample=False, eos_token_id=eos, quasar_config=quasar)
    assert torch.equal(spec, plain)
    for row, p in enumerate(prompts):
        single = speculative_generate(model, p, max_new_tokens=28, do_sample=False, eos_token_id=eos, quasar_config=quasar)
        generated = spec[row, ids.shape[1] :][: single.shape[1] - p.shape[1]]
        assert torch.equal(generated, single[0, p.shape[1] :]), f"row {row}"


def test_greedy_with_processors_matches_plain_generate():
    """Repetition penalty, no-repeat n-grams and min_new_tokens depend on each position's own prefix."""
    model = tiny_verifier()
    options = dict(max_new_tokens=30, do_sample=False, repetition_penalty=1.8, no_repeat_ngram_size=3, min_new_tokens=12)
    for drafter in ["ngram", "assistant_self"]:
        quasar = drafter_configs(model)[drafter]
        for seed in range(3):
            prompt = repetitive_prompt(seed)
            assert torch.equal(
                speculative_generate(model, prompt, quasar_config=quasar, **options), model.generate(prompt, **options)
            )


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 6, 7, 13])
def test_max_new_tokens_is_exact_even_when_every_draft_is_accepted(max_new_tokens):
    model = tiny_verifier()
    prompt = repetitive_prompt(0)
    quasar = QuasarGenerationConfig(drafter="assistant", assistant_model=model)
    out = speculative_generate(
        model, prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, quasar_config=quasar
    )
    plain = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    assert out.shape[1] == prompt.shape[1] + max_new_tokens and torch.equal(out, plain)


def test_eos_inside_an_accepted_run_ends_the_row_there():
    model = tiny_verifier()
    prompt = repetitive_prompt(1)
    free = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    eos = int(free[0, prompt.shape[1] + 3])  # the 4th generated token
    stop_at = (free[0, prompt.shape[1] :] == eos).nonzero()[0].item() + 1
    quasar = QuasarGenerationConfig(drafter="assistant", assistant_model=model)  # accepts 5 drafts per step
    out = speculative_generate(
        model, prompt, max_new_tokens=20, do_sample=False, eos_token_id=eos, quasar_config=quasar, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, free[:, : prompt.shape[1] + stop_at])
    assert out.quasar_stats.accepted_tokens >= stop_at - 2  # the eos came out of an accepted run


def test_stop_strings_match_plain_generate():
    from transformers import AutoTokenizer

    from quasar_hf.models import smollm2_135m_instruct

    tokenizer = AutoTokenizer.from_pretrained(smollm2_135m_instruct())
    model = tiny_verifier(vocab=len(tokenizer))
    prompt = tokenizer("The cat sat on the mat. The cat sat on the mat. The cat", return_tensors="pt").input_ids
    free = model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None)
    stop = tokenizer.decode(free[0, prompt.shape[1] + 5 : prompt.shape[1] + 7])
    options = dict(max_new_tokens=16, do_sample=False, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer)
    plain = model.generate(prompt, **options)
    assert plain.shape[1] < free.shape[1]  # the stop string did stop plain generation
    for quasar in [QuasarGenerationConfig(), QuasarGenerationConfig(drafter="assistant", assistant_model=model)]:
        assert torch.equal(speculative_generate(model, prompt, quasar_config=quasar, **options), plain)


class RecordingStreamer:
    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("drafter", ["ngram", "assistant_self"])
def test_streamer_receives_exactly_the_returned_tokens(drafter):
    model = tiny_verifier()
    prompt = repetitive_prompt(2)
    streamer = RecordingStreamer()
    out = speculative_generate(
        model, prompt, max_new_tokens=25, do_sample=False, streamer=streamer, quasar_config=drafter_configs(model)[drafter]
    )
    assert torch.equal(streamer.chunks[0].view(-1), prompt[0]) and streamer.ended
    streamed = torch.cat([c.view(-1) for c in streamer.chunks[1:]])
    assert torch.equal(streamed, out[0, prompt.shape[1] :])


def test_return_dict_and_stats_are_consistent():
    model = tiny_verifier()
    prompt = repetitive_prompt(0)
    out = speculative_generate(model, prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, return_dict_in_generate=True)
    stats = out.quasar_stats
    assert stats.new_tokens + 1 == out.sequences.shape[1] - prompt.shape[1]  # +1: the prefill's token
    assert stats.accepted_tokens == stats.new_tokens - stats.verify_steps
    assert stats.mean_acceptance_length == pytest.approx(stats.new_tokens / stats.verify_steps)
    assert len(stats.acceptance_per_position) <= 5 and all(0 <= r <= 1 for r in stats.acceptance_per_position)
    assert stats.verify_time_s > 0 and stats.draft_time_s >= 0
    assert stats.verifier_forwards == stats.verify_steps and 0 < stats.forward_time_s < stats.verify_time_s
    assert stats.loop_time_per_step_s == pytest.approx(
        (stats.draft_time_s + stats.verify_time_s - stats.forward_time_s) / stats.verifier_forwards
    )


class CountingDrafter(NgramDrafter):
    """A custom drafter object (the interface admits any Drafter) that records the batch it drafts for."""

    def __init__(self):
        super().__init__()
        self.batch_sizes = []

    def propose(self, sequences, max_tokens):
        self.batch_sizes.append(len(sequences))
        return super().propose(sequences, max_tokens)


def test_finished_rows_leave_the_batch():
    model = tiny_verifier()
    prompts = [repetitive_prompt(0), repetitive_prompt(1)]
    ids, mask = left_padded(prompts)
    drafter = CountingDrafter()
    out = speculative_generate(
        model,
        ids,
        mask,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=None,
        quasar_config=QuasarGenerationConfig(drafter=drafter),
        stop_strings=None,
        stopping_criteria=_stop_row0_after(int(ids[0, 0]), ids.shape[1] + 4),
    )
    assert drafter.batch_sizes[0] == 2 and drafter.batch_sizes[-1] == 1
    assert out[0, ids.shape[1] + 4 :].eq(0).all()  # the finished row is right-padded with pad_token_id


def _stop_row0_after(first_token, length):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopFirstRow(StoppingCriteria):
        """Stops the row whose prompt starts with `first_token` once it is `length` tokens long."""

        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids[:, 0] == first_token) & (input_ids.shape[1] >= length)

    return StoppingCriteriaList([StopFirstRow()])


def test_unsupported_options_raise_clear_errors():
    model = tiny_verifier()
    prompt = repetitive_prompt(0)
    with pytest.raises(ValueError, match="beam search"):
        speculative_generate(model, prompt, num_beams=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="'dynamic' or 'static'"):
        speculative_generate(model, prompt, cache_implementation="offloaded", max_new_tokens=4)
    with pytest.raises(ValueError, match="left padding"):
        speculative_generate(model, prompt, torch.cat([torch.ones(1, prompt.shape[1] - 1), torch.zeros(1, 1)], 1).long())
    with pytest.raises(ValueError, match=r"draft_layers"):
        speculative_generate(model, prompt, quasar_config={"drafter": "self"}, max_new_tokens=4)
    with pytest.raises(ValueError, match="Unknown drafter"):
        speculative_generate(model, prompt, quasar_config={"drafter": "eagle"}, max_new_tokens=4)
    with pytest.raises(ValueError, match="assistant model"):
        speculative_generate(model, prompt, quasar_config={"drafter": "assistant"}, max_new_tokens=4)
    with pytest.raises(ValueError, match="Unknown quasar option"):
        QuasarGenerationConfig.from_value({"num_draft": 3})
    with pytest.raises(ValueError, match="Use 'rowstable_attention' for 'shape_stable_attention'"):
        QuasarGenerationConfig.from_value({"shape_stable_attention": False})
    with pytest.raises(TypeError, match="quasar= takes"):
        QuasarGenerationConfig.from_value("yes")


def test_bound_generate_routes_quasar_models_and_refuses_plain_ones():
    model = tiny_verifier()
    prompt = repetitive_prompt(0)
    plain = model.generate(prompt, max_new_tokens=20, do_sample=False)
    with pytest.raises(ValueError, match="quasar"):  # a stock model: Transformers' own unused-kwarg error
        model.generate(prompt, max_new_tokens=20, quasar=True)
    bind_quasar_methods(model)  # what the quantizer does on load
    with pytest.raises(ValueError, match="QuasarConfig"):
        model.generate(prompt, max_new_tokens=20, quasar=True)
    model.config.quantization_config = {"quant_method": "quasar"}  # what is_quasar_model reads
    out = model.generate(prompt, max_new_tokens=20, do_sample=False, quasar=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain) and out.quasar_stats.verify_steps > 0
    out = model.generate(
        prompt, max_new_tokens=20, do_sample=False, assistant_model=tiny_verifier(seed=7), return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, plain) and out.quasar_stats is not None  # assistant drafts, our verifier loop
    out = model.generate(prompt, max_new_tokens=20, do_sample=False, quasar={"drafter": "ngram", "num_draft_tokens": 3})
    assert torch.equal(out, plain)


def test_batched_attention_mode_verifies_the_same_way_and_counts_the_same_steps():
    """rowstable_attention=False (one batched attention call per layer): on a float32 model the
    output still equals plain greedy here, and the drafts/acceptances it records are real."""
    model = tiny_verifier("llama")
    for seed in range(2):
        prompt = repetitive_prompt(seed)
        plain = model.generate(prompt, max_new_tokens=32, do_sample=False)
        fast = speculative_generate(
            model,
            prompt,
            max_new_tokens=32,
            do_sample=False,
            return_dict_in_generate=True,
            quasar_config=QuasarGenerationConfig(rowstable_attention=False),
        )
        assert torch.equal(fast.sequences, plain)
        assert fast.quasar_stats.drafted_tokens > 0
