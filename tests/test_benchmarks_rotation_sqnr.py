"""`python -m benchmarks rotation-sqnr`: the treatments on synthetic inputs with an outlier channel (no model runs)."""

from __future__ import annotations

import torch

from benchmarks.fidelity.rotation_sqnr import to_markdown, treatments


def test_treatments_rank_as_expected_on_an_outlier_channel():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen)
    x[:, 3] *= 200.0  # the heavy-tailed channel SmoothQuant and rotation both target
    weight = torch.randn(32, 256, generator=gen)
    errors = treatments(x, weight, head_dim=64, kind="o_proj")
    assert set(errors) == {"none", "smooth", "rotate", "smooth+rotate", "head-rotate"}
    assert errors["rotate"] < errors["none"] / 10 and errors["smooth"] < errors["none"]
    assert all(e >= 0 for e in errors.values())
    assert "head-rotate" not in treatments(x, weight, head_dim=64, kind="down_proj")


def test_markdown_lists_each_model_and_linear():
    summary = {t: {"sqnr_db": 40.0, "worst_layer_sqnr_db": 35.0} for t in ("none", "smooth", "rotate", "smooth+rotate")}
    report = {
        "command": "python -m benchmarks rotation-sqnr --name x",
        "environment": {"cpu": "cpu", "git_commit": "abc"},
        "runs": [{"model": "m", "tokens": 1024, "summary": {"down_proj": summary}}],
    }
    text = to_markdown(report)
    assert "| m | down_proj | 1024 | 40.0 (35.0) | 40.0 (35.0) | 40.0 (35.0) | - | 40.0 (35.0) |" in text
