"""`python -m benchmarks quantize-rss`: bad arguments are named, and a report renders every figure."""

import pytest

from benchmarks.quantize import quantize_rss


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        quantize_rss.main(["--out", str(tmp_path), "--layers", "0"])
    with pytest.raises(SystemExit):
        quantize_rss.main(["--out", str(tmp_path), "--shape", "gpt-9"])


def test_the_markdown_shows_every_figure():
    result = {
        "command": "python -m benchmarks quantize-rss --layers 4",
        "environment": {"cpus": 2},
        "result": {
            "shape": "qwen2.5-1.5b-shape",
            "layers_of_model": 28,
            "layers_done": 4,
            "seconds": 360.0,
            "seconds_per_layer": 90.0,
            "projected_total_s": 2520,
            "peak_rss_gib": 6.27,
        },
    }
    text = quantize_rss.to_markdown(result)
    assert "| qwen2.5-1.5b-shape | 4 of 28 | 360.0 | 90.0 | 2520 | 6.27 |" in text and "--layers 4" in text
