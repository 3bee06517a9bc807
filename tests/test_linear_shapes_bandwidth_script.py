"""scripts/linear_shapes_bandwidth.py: every part of a shape is timed and its bytes counted from the modules."""

from __future__ import annotations

import json

import pytest
from tiny_models import load_script


def test_smallest_shape_report(tmp_path, monkeypatch) -> None:
    script = load_script("linear_shapes_bandwidth")
    monkeypatch.setattr(script, "measure_read_bandwidth", lambda device: 10.0)  # the 512 MiB read is not the point here
    script.main(["--shapes", "smollm2-135m", "--iters", "1", "--max-layers", "2", "--out", str(tmp_path / "lsb.json")])
    result = json.loads((tmp_path / "lsb.json").read_text())
    parts = result["shapes"]["smollm2-135m"]["6"]
    hidden, inter, heads, kv, head_dim, vocab, _ = script.SHAPES["smollm2-135m"]
    assert parts["qkv"]["bytes"] == (heads + 2 * kv) * head_dim * hidden  # int8: one byte per weight
    assert parts["gate_up"]["bytes"] == 2 * inter * hidden and parts["lm_head_bf16"]["bytes"] == 2 * vocab * hidden
    assert all(p["ms"] > 0 for p in parts.values()) and parts["down"]["layers"] == 2
    assert "| smollm2-135m | 1 | down |" in (tmp_path / "lsb.md").read_text()


def test_unknown_shape_names_the_choices() -> None:
    with pytest.raises(SystemExit, match="choose from"):
        load_script("linear_shapes_bandwidth").main(["--shapes", "gpt-5"])
