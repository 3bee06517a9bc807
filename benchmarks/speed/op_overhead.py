"""Where a compiled CPU step's time goes: the per-call cost of each `torch.ops.quasar.*` op, against
the package's Python entry point for the same kernel ("direct": the bound linear, `rotate_rows`,
...) and the op a compiled step calls, which C++ serves on CPU (the packed `w8a8_linear_cpu_packed` for the
linears, each op itself for the others), times its calls per step.

A step (eager or compiled) calls our ops; on CPU the dispatcher lands in their C++ implementations
where ops/native.py's library is had, else in their plain-PyTorch fallbacks. The W8A8 linear's op
column is the generic `quasar::w8a8_linear` (a step calls the packed op instead). Shapes are the model's own, at M = 1 (decode) and M = 6 (a 5-draft
verification); each norm-folded group (NormFoldedW8A8Linear) is timed as its stacked linear.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import quasar_hf.ops.torch_ops  # noqa: F401  (registers torch.ops.quasar.*)
from quasar_hf.bench.report import markdown_table
from quasar_hf.nn import RotatedW8A8Linear, W8A8Linear
from quasar_hf.nn.rowstable_norm import RowStableRMSNorm
from quasar_hf.ops import native
from quasar_hf.ops.dispatch import bind_w8a8_linear


def _us(fn: Callable[[], object], calls: int = 300) -> float:
    """Median over 5 batches of `calls` calls, in microseconds per call."""
    for _ in range(20):
        fn()
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(batches)[2]


def _native(fn: Callable[[], object], calls: int = 300) -> float | None:
    """`_us(fn)` where the C++ library serves the ops on CPU, else None."""
    return _us(fn, calls) if native.is_available() else None


def _served(op_us: float) -> float | None:
    """An op the modules call as it is: its time again where C++ serves it (the op is its C++ implementation)."""
    return op_us if native.is_available() else None


def _linear_costs(model: torch.nn.Module, rows: int) -> dict:
    """Every W8A8 linear's op call, native call and direct call at `rows` rows: summed microseconds per step."""
    op, direct, twin, calls = 0.0, 0.0, 0.0, 0
    measured: dict[tuple, tuple[float, float, float | None]] = {}
    for module in model.modules():
        if not isinstance(module, W8A8Linear) or module.prepared is None:
            continue
        prepared = module.prepared
        key = (module.in_features, module.out_features, module.act_prescale is not None)
        if key not in measured:
            x = torch.randn(1, rows, module.in_features, dtype=model.dtype)
            packed = list(prepared.packed_tensors)
            args = (x, module.weight, module.weight_scale, module.bias, module.act_prescale, packed, prepared.backend)
            twin_args = (x, *packed, module.weight_scale, module.bias, module.act_prescale, module.out_features)
            bound = bind_w8a8_linear(*prepared.weights, prepared.backend, packed=prepared.packed)
            measured[key] = (
                _us(lambda: torch.ops.quasar.w8a8_linear.default(*args)),
                _us(lambda: bound(x)),
                _native(lambda: torch.ops.quasar.w8a8_linear_cpu_packed.default(*twin_args))
                if prepared.backend == "cpu_fused"
                else None,
            )
        op, direct, calls = op + measured[key][0], direct + measured[key][1], calls + 1
        twin = None if twin is None or measured[key][2] is None else twin + measured[key][2]
    return {"calls": calls, "op_us": op, "direct_us": direct, "native_us": twin}


def _rotation_costs(model: torch.nn.Module, rows: int) -> dict:
    rotated = [m for m in model.modules() if isinstance(m, RotatedW8A8Linear) and m._rotation_op_args is not None]
    if not rotated:
        return {"calls": 0, "op_us": 0.0, "direct_us": 0.0, "native_us": None}
    module = rotated[0]
    x = torch.randn(1, rows, module.in_features, dtype=model.dtype)
    from quasar_hf.ops import hadamard_cpu

    args = module._rotation_op_args  # what the forward passes the op (RotatedW8A8Linear.prepare)
    op = _us(lambda: torch.ops.quasar.hadamard_rows.default(x, *args))
    direct = _us(lambda: hadamard_cpu.rotate_rows(x, module.rotation))
    twin = _served(op)
    n = len(rotated)
    return {"calls": n, "op_us": op * n, "direct_us": direct * n, "native_us": None if twin is None else twin * n}


def _norm_costs(model: torch.nn.Module, rows: int) -> dict:
    """Compiled, every norm is one `quasar::rms_norm` call (a Python formula of torch ops)."""
    norms = [m for m in model.modules() if isinstance(m, RowStableRMSNorm)]
    if not norms:
        return {"calls": 0, "op_us": 0.0, "direct_us": None, "native_us": None}
    norm = norms[0]
    x = torch.randn(1, rows, norm.weight.shape[0], dtype=model.dtype)
    op = _us(lambda: torch.ops.quasar.rms_norm.default(x, norm.weight, *norm.formula))
    twin = _served(op)
    n = len(norms)
    return {"calls": n, "op_us": op * n, "direct_us": None, "native_us": None if twin is None else twin * n}


def _attention_costs(model: torch.nn.Module, rows: int, context: int) -> dict:
    from quasar_hf.ops import attention_cpu

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q = torch.randn(1, c.num_attention_heads, rows, head_dim, dtype=model.dtype)
    k = torch.randn(1, c.num_key_value_heads, context, head_dim, dtype=model.dtype)
    visible = torch.ones(1, rows, context, dtype=torch.bool)
    scale = head_dim**-0.5
    op = _us(lambda: torch.ops.quasar.rowstable_attention.default(q, k, k, visible, scale), 100)
    direct = _us(lambda: attention_cpu.rowstable_attention(q, k, k, visible, scale), 100)
    twin = _served(op)
    n = c.num_hidden_layers
    return {"calls": n, "op_us": op * n, "direct_us": direct * n, "native_us": None if twin is None else twin * n}


def _lm_head_costs(model: torch.nn.Module, rows: int) -> dict:
    """The float lm_head (`RowStableLinear`): one `quasar::rowstable_linear` call per step."""
    from quasar_hf.nn.rowstable_linear import RowStableLinear
    from quasar_hf.ops import rowstable_linear

    head = model.get_output_embeddings()
    if not isinstance(head, RowStableLinear) or not rowstable_linear.is_available():
        return {"calls": 0, "op_us": 0.0, "direct_us": 0.0, "native_us": None}
    x = torch.randn(1, rows, head.in_features, dtype=model.dtype)
    op = _us(lambda: torch.ops.quasar.rowstable_linear.default(x, head.weight, head.bias), 10)
    direct = _us(lambda: rowstable_linear.rowstable_linear(x, head.weight, head.bias), 10)
    twin = _served(op)
    return {"calls": 1, "op_us": op, "direct_us": direct, "native_us": twin}


def op_overhead(model: torch.nn.Module, context: int, rows_list: tuple[int, ...] = (1, 6)) -> dict:
    """Per step shape: calls, op microseconds and direct-kernel microseconds per op kind, and totals."""
    out = {}
    with torch.no_grad():
        for rows in rows_list:
            kinds = {
                "w8a8_linear": _linear_costs(model, rows),
                "hadamard_rows": _rotation_costs(model, rows),
                "rms_norm": _norm_costs(model, rows),
                "rowstable_attention_cpu": _attention_costs(model, rows, context),
                "rowstable_linear (lm_head)": _lm_head_costs(model, rows),
            }
            extra = sum(k["op_us"] - k["direct_us"] for k in kinds.values() if k["direct_us"] is not None)
            twins = [k["native_us"] for k in kinds.values() if k["calls"]]
            out[str(rows)] = {
                "kinds": kinds,
                "ops_ms": sum(k["op_us"] for k in kinds.values()) / 1e3,
                "dispatch_and_python_ms": extra / 1e3,
                "native_ops_ms": None if None in twins else sum(twins) / 1e3,
            }
    return out


def markdown(result: dict) -> list[str]:
    lines = [
        "Our ops' share of the compiled step (`benchmarks/speed/op_overhead.py`: each op called through",
        "`torch.ops.quasar` vs its kernel called directly, the model's shapes, the same weight each call,",
        "so a small weight stays in cache and its times are below a step's, which streams every weight):",
        "",
    ]
    rows = []
    for tokens, entry in result.items():
        for name, k in entry["kinds"].items():
            direct = None if k["direct_us"] is None else k["direct_us"] / 1e3
            extra = None if k["direct_us"] is None else (k["op_us"] - k["direct_us"]) / 1e3
            twin = None if k.get("native_us") is None else k["native_us"] / 1e3
            rows.append([tokens, name, k["calls"], k["op_us"] / 1e3, direct, extra, twin])
        total = [tokens, "all ops", "", entry["ops_ms"], None, entry["dispatch_and_python_ms"], entry.get("native_ops_ms")]
        rows.append(total)
    header = [
        "tokens", "op", "calls / step", "Python op ms / step", "direct ms / step", "dispatch + Python ms / step",
        "native op ms / step (what a compiled CPU step calls)",
    ]  # fmt: skip
    lines += markdown_table(header, rows)
    return lines
