"""drafter="auto": n-gram, self or no drafts per step and row; greedy output equals plain greedy."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quasar_hf import QuasarConfig, QuasarGenerationConfig
from quasar_hf.speculative import DRAFTER_FACTORIES, NgramDrafter, speculative_generate
from quasar_hf.speculative.auto_drafter import AutoDrafter, auto_factory
from quasar_hf.speculative.left_padding import left_padded
from tests.helpers.tiny_models import char_tokenizer, tiny_model

FAST = dict(num_calibration_samples=4, calibration_seq_len=64)
PROMPTS = ["the cat sat on the mat; the cat sat on the", "abcabcabcabc", "def f(x): return x + 1\ndef g(x"]
NEVER_PAUSE = {"min_gain": 0.0}
PAYING_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny W8A8 models: with a draft path + reduced head, with a draft path only, and without."""
    src = tmp_path_factory.mktemp("auto_src")
    tiny_model("llama", layers=4, seed=3).save_pretrained(src)
    char_tokenizer().save_pretrained(src)

    def load(**kwargs):
        return AutoModelForCausalLM.from_pretrained(src, quantization_config=QuasarConfig(**FAST, **kwargs), dtype=torch.float32)

    built = {
        "reduced": load(draft_layers=[0, 3], draft_dtype="int8", draft_vocab_size=40),
        "self": load(draft_layers=[0, 3], draft_dtype="model"),
        "none": load(),
    }
    for name in ("reduced", "self"):  # random weights agree on nothing: record a paying draft path instead
        built[name].config.quantization_config.draft_info["top1_agreement"] = PAYING_AGREEMENT
    return built


def ids_of(text):
    return char_tokenizer()(text, return_tensors="pt").input_ids


def test_auto_is_registered_and_picks_the_models_drafter(models):
    assert "auto" in DRAFTER_FACTORIES

    def built(name, **kwargs):
        return auto_factory(models[name], QuasarGenerationConfig(drafter="auto", drafter_kwargs=kwargs))

    assert built("reduced").model_drafter.model.lm_head.__class__.__name__ == "ReducedVocabLogits"
    assert (
        built("self", model_drafter="self").model_drafter is not None
    )  # fp32 copies of a tiny model: named, not predicted to pay
    assert built("none").model_drafter is None and isinstance(built("none").ngram, NgramDrafter)
    assert built("reduced", model_drafter="self").model_drafter.model.lm_head is models["reduced"].lm_head
    with pytest.raises(ValueError, match="draft_layers"):
        built("none", model_drafter="self")
    with pytest.raises(ValueError, match="needs at least one source"):
        built("none", ngram=False)
    with pytest.raises(ValueError, match="unknown drafter_kwargs"):
        built("none", colour="red")


@pytest.mark.parametrize(
    "name,policy",
    [
        ("reduced", None),
        ("reduced", NEVER_PAUSE),
        ("reduced", {"min_gain": 100.0, "warmup_steps": 1, "pause_steps": 2}),  # pauses often
        ("self", None),
        ("none", None),
    ],
)
def test_auto_greedy_equals_plain_greedy(models, name, policy):
    model = models[name]
    quasar = QuasarGenerationConfig(drafter="auto", drafter_kwargs={} if policy is None else {"policy": policy})
    for text in PROMPTS:
        ids = ids_of(text)
        plain = model.generate(ids, max_new_tokens=24, do_sample=False, quasar=False)
        out = model.generate(ids, max_new_tokens=24, do_sample=False, quasar=quasar, return_dict_in_generate=True)
        assert torch.equal(out.sequences, plain), text


def test_calibration_prior_starts_the_model_policy_and_a_losing_path_is_left_out(models, monkeypatch):
    model = models["reduced"]
    drafter = auto_factory(model, QuasarGenerationConfig(drafter="auto"))
    prior = drafter.model_drafter.calibration_prediction
    assert prior["acceptance"] == PAYING_AGREEMENT and prior["predicted_speedup"] > 1
    assert drafter.model_policy.warmup_steps == 1 and drafter.model_policy.length == prior["draft_tokens"]
    assert drafter.model_policy.acceptance == pytest.approx(PAYING_AGREEMENT)
    assert drafter.ngram_policy.warmup_steps == 3  # the n-gram policy keeps the defaults
    assert drafter.ngram_policy.min_tokens == drafter.ngram_policy.max_tokens == 5  # free drafts keep their length
    assert drafter.ngram_policy.max_pause_steps == 4  # and pause briefly
    mine = auto_factory(model, QuasarGenerationConfig(drafter="auto", drafter_kwargs={"policy": {"warmup_steps": 5}}))
    assert mine.model_policy.warmup_steps == 5  # options the caller sets win over the prior

    assert drafter.model_policy.pause_steps == 4  # a paying path keeps the default pauses

    monkeypatch.setitem(model.config.quantization_config.draft_info, "top1_agreement", 0.0)
    losing = auto_factory(model, QuasarGenerationConfig(drafter="auto"))
    assert losing.model_drafter is None and "predicts" in losing.summary()["model_left_out"]
    named = auto_factory(model, QuasarGenerationConfig(drafter="auto", drafter_kwargs={"model_drafter": "self_reduced"}))
    assert named.model_drafter is not None  # asked for by name: kept, and the policy decides at run time
    alone = auto_factory(model, QuasarGenerationConfig(drafter="auto", drafter_kwargs={"ngram": False}))
    assert alone.model_drafter is not None
    assert alone.model_policy.pause_steps == 16 and alone.model_policy.max_pause_steps == 256  # expected to lose: probe rarely
    capped = {
        "ngram": False,
        "policy": {"max_pause_steps": 4},
    }  # the caller's pauses are kept whole, never mixed with the prior's
    assert auto_factory(model, QuasarGenerationConfig(drafter="auto", drafter_kwargs=capped)).model_policy.pause_steps == 4


def test_auto_uses_both_sources_and_equals_plain_in_a_batch(models):
    """Rows with an n-gram match take n-gram drafts, the others the self-draft path; rejected self drafts
    of rows that used n-gram drafts are rolled back (checked by equality with plain batched greedy)."""
    model = models["reduced"]
    prompts = [ids_of(t) for t in PROMPTS + ["xyz"]]
    ids, mask = left_padded(prompts, pad=96)
    drafter = auto_factory(model, QuasarGenerationConfig(drafter="auto", drafter_kwargs={"policy": NEVER_PAUSE}))
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, quasar=False)
    out = speculative_generate(model, ids, mask, max_new_tokens=20, do_sample=False, quasar_config={"drafter": drafter})
    assert torch.equal(out, plain)
    assert drafter.steps_by_source["ngram"] > 0 and drafter.steps_by_source["model"] > 0


def test_auto_alone_self_drafting_is_adaptive_self(models):
    """ngram=False: every draft comes from the model's draft path (adaptive self-drafting)."""
    model = models["self"]
    drafter = auto_factory(model, QuasarGenerationConfig(drafter="auto", drafter_kwargs={"ngram": False, "policy": NEVER_PAUSE}))
    ids = ids_of(PROMPTS[0])
    out = speculative_generate(model, ids, max_new_tokens=16, do_sample=False, quasar_config={"drafter": drafter})
    assert torch.equal(out, model.generate(ids, max_new_tokens=16, do_sample=False, quasar=False))
    assert drafter.steps_by_source["ngram"] == 0 and drafter.steps_by_source["model"] > 0


def test_auto_sampling_mixes_one_hot_and_model_probabilities(models):
    """With sampling, rows drafted by n-gram get one-hot q and the others the model's q (valid distributions)."""
    model = models["reduced"]
    drafter = auto_factory(model, QuasarGenerationConfig(drafter="auto", drafter_kwargs={"policy": NEVER_PAUSE}))
    prompts = [ids_of(PROMPTS[1]), ids_of("xyz")]
    ids, mask = left_padded(prompts, pad=96)
    generator = torch.Generator().manual_seed(0)
    out = speculative_generate(
        model, ids, mask, max_new_tokens=16, do_sample=True, generator=generator, quasar_config={"drafter": drafter}
    )
    assert out.shape == (2, ids.shape[1] + 16)
    seen = {}
    original = drafter._combine

    def spy(rows, source, model_draft):
        draft = original(rows, source, model_draft)
        if draft.probs is not None:
            seen["sums"] = draft.probs.sum(-1)[torch.arange(draft.tokens.shape[1])[None] < draft.lengths[:, None]]
        return draft

    drafter._combine = spy
    drafter.steps_by_source = dict.fromkeys(drafter.steps_by_source, 0)
    speculative_generate(
        model, ids, mask, max_new_tokens=8, do_sample=True, generator=generator, quasar_config={"drafter": drafter}
    )
    assert "sums" in seen
    torch.testing.assert_close(seen["sums"], torch.ones_like(seen["sums"]))


def test_auto_drafter_needs_a_source():
    with pytest.raises(ValueError, match="at least one source"):
        AutoDrafter(None, None)


@pytest.mark.slow
def test_smollm2_auto_and_reduced_head_equal_plain_greedy(tmp_path):
    """SmolLM2-135M W8A8 (float32: exact equality) with a reduced draft head: 2 prompts x 24 tokens."""
    from transformers import AutoTokenizer

    from quasar_hf.bench.suites import load_suite, render_prompt
    from quasar_hf.models import smollm2_135m_instruct

    source = smollm2_135m_instruct()
    config = QuasarConfig(
        alpha=0.7,
        num_calibration_samples=2,
        calibration_seq_len=64,
        draft_layers=list(range(15)),
        draft_dtype="int8",
        weight_rounding="nearest",
        draft_vocab_size=4096,
    )
    model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(source)
    items = load_suite("grounded")[:1] + load_suite("chat")[:1]
    for item in items:
        ids = torch.tensor([render_prompt(item, tok)])
        plain = model.generate(ids, max_new_tokens=24, do_sample=False, quasar=False)
        auto = {"drafter": "auto", "drafter_kwargs": {"model_drafter": "self_reduced"}}  # kept even if not predicted to pay
        for quasar in ({"drafter": "self_reduced", "num_draft_tokens": 3}, {"drafter": "auto"}, auto):
            out = model.generate(ids, max_new_tokens=24, do_sample=False, quasar=quasar)
            assert torch.equal(out, plain), f"{item['id']} {quasar}"


def test_open_suite_is_valid_and_open_ended():
    """The open-ended suite (>= 20 single-turn prompts) loads by path and states origin and licence."""
    from importlib import resources

    from quasar_hf.bench.suites import load_suite

    items = load_suite(str(resources.files("quasar_hf").joinpath("data", "prompts", "open.jsonl")))
    assert len(items) >= 20 and len({it["id"] for it in items}) == len(items)
    assert {it["task"] for it in items} == {"question", "story", "explanation"}
    assert all(it["suite"] == "open" and it["version"] == 1 and len(it["messages"]) == 1 for it in items)


class FixedModelDrafter:
    """A stand-in model drafter proposing token 50 repeatedly."""

    def start(self, prompts, setup):
        pass

    def propose(self, sequences, max_tokens):
        from quasar_hf.speculative.drafters import Draft

        k = max(max_tokens)
        return Draft(tokens=torch.full((len(sequences), k), 50), lengths=torch.tensor(max_tokens))

    def on_accept(self, num_accepted):
        pass

    def select_rows(self, rows):
        pass


def test_displaced_ngram_drafts_are_scored_against_the_emitted_tokens():
    from quasar_hf.speculative.drafters import DraftSetup

    drafter = AutoDrafter(NgramDrafter(3), FixedModelDrafter(), 3, policy={"prior_weight": 0.0, "decay": 0.5})
    drafter.ngram_policy.draft_s_per_token, drafter.ngram_policy.plain_step_s = 0.0, 1.0  # measured: finite gain
    drafter.start([torch.tensor([1, 2])], DraftSetup(False, None, None, torch.device("cpu")))
    draft = drafter.propose([torch.tensor([1, 2, 3, 1, 2])], [3])  # the unmeasured model source is tried first
    assert draft.tokens[0].tolist() == [50, 50, 50] and drafter.steps_by_source["model"] == 1
    drafter.on_accept(torch.tensor([0]))
    before = (drafter.ngram_policy.accepted_mass, drafter.ngram_policy.trial_mass)
    drafter.propose([torch.tensor([1, 2, 3, 1, 2, 3, 1, 9])], [3])  # n-gram had proposed [3, 1, 2]
    assert drafter.ngram_policy.accepted_mass == pytest.approx(0.5 * before[0] + 2)  # 3, 1 agree
    assert drafter.ngram_policy.trial_mass == pytest.approx(0.5 * before[1] + 3)  # then 2 != 9: one failure


def test_a_new_call_forgets_the_last_calls_rows():
    """The serving engine keeps one drafter across batches: a draft displaced in a batch of two rows is not scored
    against row 1 of the next call, which has one row."""
    from quasar_hf.speculative.drafters import DraftSetup

    drafter = AutoDrafter(NgramDrafter(3), FixedModelDrafter(), 3, policy={"prior_weight": 0.0})
    drafter.ngram_policy.draft_s_per_token, drafter.ngram_policy.plain_step_s = 0.0, 1.0
    setup = DraftSetup(False, None, None, torch.device("cpu"))
    drafter.start([torch.tensor([1, 2]), torch.tensor([1, 2])], setup)
    drafter.propose([torch.tensor([1, 2, 3, 1, 2]), torch.tensor([4, 5, 6, 4, 5])], [3, 3])  # both displaced
    assert set(drafter._shadows) == {0, 1}
    drafter.start([torch.tensor([7, 8])], setup)
    drafter.propose([torch.tensor([7, 8, 7])], [3])
