"""Inductor graph passes of compiled Quasar steps, and the CompileConfig that installs them (`compile_config`).

`FoldNormsIntoW8A8Linears` is the one grouping pattern of compiled steps. Eager, each consumer of a
FoldedRMSNorm calls `quasar::w8a8_folded_norm_linears_cpu_packed` with its own weight: the norm is
folded into that linear's quantization (nn/folded_norm.py). Compiled, model code traces the norm to
`quasar::rms_norm` and each consumer to its own `quasar::w8a8_linear_cpu_packed`, four ops for q/k/v
and three for gate/up; this pass rewrites every such group into one call of the same folded op with
all the consumers' weights: x is normalized inside its own quantization, once, and every consumer's
GEMM runs in the same C call. So a SmolLM2 step calls 182 of our ops where it would call 332, and each
consumer's output has the bits an eager consumer computes (the op gives each weight's output the
same bits whether called with one weight or several). The op is row-stable like the ops it
replaces: a compiled verify step's rows still equal compiled decode steps. Every op in the graph,
before and after the pass, is one eager code calls too (on CPU the dispatcher runs its C++
implementation, ops/native.py).

A group is rewritten only when nothing else is assumed: the norm's output feeds W8A8 linears directly
(as their x), on the "cpu_fused" backend's packed layout and no act_prescale (the fold
multiplies by the norm's weight in its place), at most MULTI_MAX of them. Other readers of the norm's
output (none in the supported architectures) keep reading `quasar::rms_norm`.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from quasar_hf import compat

_W8A8_CPU = "quasar::w8a8_linear_cpu_packed"
_RMS_NORM = "quasar::rms_norm"


def _op_name(node: torch.fx.Node) -> str | None:
    target = node.target
    return target.name() if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) else None


def _foldable_consumer(node: torch.fx.Node, norm: torch.fx.Node) -> bool:
    """A `quasar::w8a8_linear_cpu_packed(norm, ...)` that the fold computes exactly as eager's group does."""
    if _op_name(node) != _W8A8_CPU or len(node.args) != 7 or node.kwargs:
        return False
    x, _, _, _, _, act_prescale, _ = node.args
    return x is norm and act_prescale is None


def fold_group(graph: torch.fx.Graph, norm: torch.fx.Node) -> int:
    """Rewrite one `quasar::rms_norm` node and its foldable consumers; returns how many linears it folded."""
    from quasar_hf.ops.cpu_packing import MULTI_MAX

    if len(norm.args) != 5 or norm.kwargs:
        return 0
    x, weight, eps, offset, _ = norm.args
    linears = [user for user in norm.users if _foldable_consumer(user, norm)][:MULTI_MAX]
    if not linears:
        return 0
    args = (x, weight, eps, offset, *([lin.args[i] for lin in linears] for i in (1, 2, 3, 4, 6)), False)
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min(linears, key=order.__getitem__)
    inputs: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, inputs.append)
    if any(order[n] >= order[first] for n in inputs):
        return 0  # a weight defined after the first consumer (not how Dynamo lays out graphs): leave it
    with graph.inserting_before(first):
        fused = graph.call_function(torch.ops.quasar.w8a8_folded_norm_linears_cpu_packed.default, args)
    fused.meta["val"] = [lin.meta.get("val") for lin in linears]
    previous = fused
    for i, lin in enumerate(linears):
        with graph.inserting_after(previous):
            output = graph.call_function(operator.getitem, (fused, i))
        output.meta.update(lin.meta)
        lin.replace_all_uses_with(output)
        graph.erase_node(lin)
        previous = output
    if not norm.users:
        graph.erase_node(norm)
    return len(linears)


class FoldNormsIntoW8A8Linears(CustomGraphPass):
    """Post-grad pass: each RMSNorm feeding "cpu_fused" W8A8 linears becomes one call of the folded op
    eager consumers call one weight at a time (see the module docstring)."""

    def __eq__(self, other: object) -> bool:  # equal configs share one compiled step (CompileConfig compares options)
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self).__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __call__(self, graph: torch.fx.Graph) -> None:
        for norm in [node for node in graph.nodes if _op_name(node) == _RMS_NORM]:
            fold_group(graph, norm)
        graph.lint()

    def uuid(self) -> bytes:
        """Inductor's cache key: the sources of this pass and of the ops it writes."""
        from quasar_hf.ops import cpu_packing, kernel_ops

        return get_hash_for_files((__file__, kernel_ops.__file__, cpu_packing.__file__))


def compile_config(device: torch.device) -> object:
    """What `quasar={"compile": True}` compiles a step with: `compat.default_compile_config`, plus on CPU
    (where the pass's ops run) `FoldNormsIntoW8A8Linears`."""
    cpu = torch.device(device).type != "cuda"
    return compat.default_compile_config(device, FoldNormsIntoW8A8Linears() if cpu else None)
