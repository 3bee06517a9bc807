"""`python -m benchmarks scaling` (benchmarks/quantize/scaling.py) end to end on a tiny shape: checkpoint built, quantized, verify step timed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.tiny_models import char_tokenizer


def _load_script():
    from benchmarks.quantize import scaling

    return scaling


def test_real_shapes_are_the_published_configs() -> None:
    shapes = _load_script().SHAPES
    one, three, eight = shapes["llama-3.2-1b"], shapes["llama-3.2-3b"], shapes["llama-3.1-8b"]
    assert (one["hidden_size"], one["num_hidden_layers"], one["intermediate_size"], one["tie_word_embeddings"]) == (
        2048,
        16,
        8192,
        True,
    )
    assert (three["hidden_size"], three["num_hidden_layers"], three["num_attention_heads"]) == (3072, 28, 24)
    assert (eight["hidden_size"], eight["intermediate_size"], eight["tie_word_embeddings"]) == (4096, 14336, False)
    assert all(s["num_key_value_heads"] == 8 and s["vocab_size"] == 128256 for s in (one, three, eight))


def test_scaling_run_on_a_tiny_shape(tmp_path: Path) -> None:
    script = _load_script()
    script.BANDWIDTH_MIB = 8  # the mechanics, not a measurement
    char_tokenizer().save_pretrained(tmp_path / "tok")
    out = tmp_path / "scaling.json"
    argv = ["--shapes", "tiny", "--workdir", str(tmp_path / "work"), "--tokenizer", str(tmp_path / "tok")]
    argv += ["--steps", "2", "--samples", "2", "--in-process", "--keep", "--out", str(out)]
    report = script.main(argv)
    row = report["results"]["tiny"]
    index = json.loads((tmp_path / "work" / "tiny" / "model.safetensors.index.json").read_text())
    assert row["bf16_bytes"] == index["metadata"]["total_size"] > 0
    assert "lm_head.weight" not in index["weight_map"]  # tied: one copy on disk
    assert row["int8_weight_bytes"] == 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)
    assert row["floor_ms"] > 0 and row["step_1_ms"] > 0 and row["step_6_ms"] > 0
    assert json.loads(out.read_text())["results"]["tiny"] == row
    assert "| tiny |" in out.with_suffix(".md").read_text()
