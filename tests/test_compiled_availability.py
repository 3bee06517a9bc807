"""Kernel availability inside compiled steps: decided before compiling, read as constants, never traced.

A compiled step reaches the questions "does the row-stable kernel serve this device?" (attention, the
lm_head). Each answer must come from a plain function that torch.compile calls instead of tracing
(`torch.compiler.assume_constant_result`): Dynamo 2.11 ignores that mark on a functools cache wrapper
and traced into the first-use check (a `torch.Generator`, a Triton launch), so every compiled step
failed on the H200. Here each check runs inside `torch.compile(fullgraph=True)` on CPU, on whatever
torch this suite runs.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import quasar_hf
from quasar_hf.ops import attention_cpu, rowstable_linear
from quasar_hf.ops.rowstable_attention import decide_kernels, rowstable_kernel_for

triton_attention = pytest.importorskip("quasar_hf.ops.triton_attention")
PACKAGE = pathlib.Path(quasar_hf.__file__).parent
_CACHES = {"cache", "lru_cache", "cached_property"}


def _decorator_names(node: ast.FunctionDef) -> set[str]:
    names = set()
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        names.add(target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", ""))
    return names


def test_no_constant_marked_function_is_a_cache_wrapper() -> None:
    both = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                names = _decorator_names(node)
                if "assume_constant_result" in names and names & _CACHES:
                    both.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert not both, f"assume_constant_result on a cache wrapper is traced into by some torch versions: {both}"


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="eager")


@pytest.mark.parametrize(
    "check",
    [
        lambda x: triton_attention.works_on(x.device),
        lambda x: triton_attention.supports(x[None, None], x[None, None], x[None, None]),
        lambda x: attention_cpu.serves(),
        lambda x: attention_cpu.unavailable_reason() is None,
        lambda x: rowstable_linear.available_when_compiled(),
    ],
    ids=["triton_works_on", "triton_supports", "cpu_serves", "cpu_reason", "lm_head"],
)
def test_each_availability_check_runs_inside_a_full_graph(check) -> None:
    x = torch.ones(4, 8)
    expected = bool(check(x))

    def step(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if check(x) else x - 1

    assert torch.equal(_compiled(step)(x), x + 1 if expected else x - 1)


def test_attention_kernel_choice_traces_on_cpu() -> None:
    """What QUASAR_ATTENTION asks per call, traced: the kernel (or None) for these tensors."""
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 5, 16)
    expected = rowstable_kernel_for(q, k, k) is not None

    def step(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q + 1 if rowstable_kernel_for(q, k, k) is not None else q - 1

    assert torch.equal(_compiled(step)(q, k), q + 1 if expected else q - 1)


def test_kernels_are_decided_before_a_step_is_compiled() -> None:
    """decide_kernels runs the first-use checks eagerly; afterwards the answer is recorded, so tracing a step
    never runs one."""
    assert decide_kernels("cpu") == attention_cpu.is_available()
    assert decide_kernels("meta") is False
    triton_attention.works_on(torch.device("cpu"))
    assert torch.device("cpu") in triton_attention._CHECKED
