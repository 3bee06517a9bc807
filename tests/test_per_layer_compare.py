"""`python -m benchmarks per-layer-compare`: two per-layer reports side by side."""

import json

import pytest

from benchmarks.fidelity import per_layer_compare


def report(model: str, down_act: float, command: str) -> dict:
    def entry(act: float) -> dict:
        return {"both_sqnr_db": act - 1.0, "act_sqnr_db": act, "weight_sqnr_db": 40.0}

    rows = [{"name": f"model.layers.{i}.mlp.down_proj", "layer": i, "kind": "down_proj", **entry(down_act + i)} for i in range(2)]
    return {
        "model": model,
        "command": command,
        "quantization": "q",
        "heldout": "8 x 256",
        "report": {"rows": rows, "totals": entry(down_act), "by_kind": {"down_proj": entry(down_act)}},
    }


def test_the_comparison_shows_both_reports_and_the_change_per_layer(tmp_path):
    paths = []
    for name, act in (("a", 30.0), ("b", 33.5)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report("m", act, f"make {name}")))
    out = per_layer_compare.main([*map(str, paths), "--labels", "smooth", "rotated", "--out", str(tmp_path), "--name", "c"])
    text = open(out[0]).read()
    assert "`make a`" in text and "`make b`" in text and "## down_proj, per layer" in text
    layer_one = next(line for line in text.splitlines() if line.startswith("| 1 |"))
    assert "31.000 | 34.500 | 3.500" in layer_one  # act-only SQNR: first, second, change


def test_reports_of_different_models_are_refused(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(report("m", 30.0, "x")))
    b.write_text(json.dumps(report("other", 30.0, "y")))
    with pytest.raises(SystemExit):
        per_layer_compare.main([str(a), str(b), "--out", str(tmp_path), "--name", "c"])
