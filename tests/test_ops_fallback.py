"""A fallback that costs speed is visible: one warning with the reason, `backend_report()`, and
`quasar-hf doctor` listing every backend and kernel."""

from __future__ import annotations

import logging

import pytest
import torch

from quasar_hf.cli import main
from quasar_hf.ops import attention_cpu, cpu_fused, dispatch
from quasar_hf.ops.backend_report import backend_report
from quasar_hf.ops.fallback import warn_fallback_once
from quasar_hf.ops.reference import quantize_weight_per_channel

REASON = "no C++ compiler found (install g++ or set $CXX)"


@pytest.fixture
def fresh_warnings():
    """Each test sees its fallback warnings afresh (they are cached once per process)."""
    warn_fallback_once.cache_clear()
    yield
    warn_fallback_once.cache_clear()


def _fallback_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and "runs instead" in r.getMessage()]


def test_auto_without_the_fused_kernel_warns_once_with_the_reason(monkeypatch, caplog, fresh_warnings):
    monkeypatch.setattr(cpu_fused, "unavailable_reason", lambda: REASON)
    w_q, w_scale = quantize_weight_per_channel(torch.randn(8, 16))
    with caplog.at_level(logging.WARNING, logger="quasar_hf.ops"):
        assert dispatch.resolve_backend("auto", "cpu") == "torch"
        dispatch.w8a8_linear(torch.randn(2, 16), w_q, w_scale)
        dispatch.bind_w8a8_linear(w_q, w_scale)(torch.randn(3, 16))
    records = _fallback_records(caplog)
    assert len(records) == 1
    message = records[0].getMessage()
    assert "'cpu_fused'" in message and "'torch'" in message and REASON in message


def test_no_warning_when_the_fast_kernel_is_used_or_a_backend_is_named(monkeypatch, caplog, fresh_warnings):
    with caplog.at_level(logging.WARNING, logger="quasar_hf.ops"):
        dispatch.resolve_backend("torch", "cpu")
        if cpu_fused.is_available():
            dispatch.resolve_backend("auto", "cpu")
    assert _fallback_records(caplog) == []


def test_attention_without_the_kernel_warns_once_with_the_reason(monkeypatch, caplog, fresh_warnings):
    monkeypatch.setattr(attention_cpu, "unavailable_reason", lambda: REASON)
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 5, 8)
    with caplog.at_level(logging.WARNING, logger="quasar_hf.ops"):
        assert not attention_cpu.supports(q, k, k)
        assert not attention_cpu.supports(q, k, k)
    records = _fallback_records(caplog)
    assert len(records) == 1
    assert "row-stable CPU attention" in records[0].getMessage() and REASON in records[0].getMessage()


def test_attention_unsupported_dtype_is_not_a_fallback_warning(caplog, fresh_warnings):
    q, k = torch.randn(1, 4, 2, 8, dtype=torch.float16), torch.randn(1, 2, 5, 8, dtype=torch.float16)
    with caplog.at_level(logging.WARNING, logger="quasar_hf.ops"):
        assert not attention_cpu.supports(q, k, k)
    assert _fallback_records(caplog) == []


def test_backend_report_lists_every_backend_with_a_reason_when_unusable(monkeypatch):
    monkeypatch.setattr(cpu_fused, "unavailable_reason", lambda: REASON)
    rows = backend_report()
    cpu_linear = {r.name: r for r in rows if r.kernel == "w8a8_linear" and r.device == "cpu"}
    assert set(cpu_linear) == set(dispatch.BACKENDS)
    assert cpu_linear["cpu_fused"].usable is False and cpu_linear["cpu_fused"].reason == REASON
    assert cpu_linear["torch"].auto and not cpu_linear["cpu_fused"].auto
    assert all((r.reason is None) == r.usable for r in rows)
    assert {(r.kernel, r.name) for r in rows} >= {("attention", "rowstable_cpu"), ("attention", "rowstable_triton")}
    assert sum(r.auto for r in rows if r.kernel == "w8a8_linear" and r.device == "cpu") == 1


def test_doctor_prints_versions_and_every_backend(monkeypatch, capsys):
    monkeypatch.setattr(cpu_fused, "unavailable_reason", lambda: REASON)
    assert main(["doctor", "--no-compile-check"]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "transformers", "triton", "CUDA", *dispatch.BACKENDS, "rowstable_cpu", "rowstable_triton"):
        assert name in out
    assert f"cpu_fused         unavailable: {REASON}" in out
    assert torch.__version__ in out


def test_doctor_checks_that_compiled_steps_work_and_says_why_not(monkeypatch, capsys):
    from quasar_hf.commands import doctor
    from quasar_hf.speculative import step_compiler

    assert doctor.compiled_steps_check().startswith("works (")

    def broken(*args, **kwargs):
        raise RuntimeError("InductorError: no C++ compiler found")

    monkeypatch.setattr(step_compiler, "compiled_step", broken)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "Compiled steps" in out and "unavailable: RuntimeError: InductorError: no C++ compiler found" in out
    assert "g++" in out
    assert main(["doctor", "--no-compile-check"]) == 0 and "Compiled steps" not in capsys.readouterr().out
