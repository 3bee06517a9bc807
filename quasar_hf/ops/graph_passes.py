"""Inductor graph passes of compiled Quasar steps, and the CompileConfig that installs them (`compile_config`).

`FoldNormsIntoW8A8Linears` gives a compiled step the fold eager mode has (nn/folded_norm.py): model
code traces each FoldedRMSNorm to `quasar::rms_norm` and each of its consumers to its own
`quasar::w8a8_linear`, four ops for q/k/v and three for gate/up. The pass rewrites every such group
into one `quasar::w8a8_folded_norm_linears`: x is normalized inside its own quantization, once, and
every consumer's GEMM runs in the same C call (`cpu_fused_multi.folded_linears_prepacked`). So a
SmolLM2 step calls 182 of our ops where it called 332, and each consumer's output has the bits
eager's folded group gives it. The op is row-stable like the ops it replaces: a compiled verify
step's rows still equal compiled decode steps. Then, where ops/native.py's library is had, each CPU
kernel op (W8A8 linears, folded groups, attention, the lm_head, the norms left, the Hadamard
rotations) is pointed at its C++-registered twin (`use_native_ops`): the same tensors, the same C
entry point, the same bits, no Python between the step's kernels.

A group is rewritten only when nothing else is assumed: the norm's output feeds W8A8 linears directly
(as their x), on the "cpu_fused" backend with prepacked weights and no act_prescale (the fold
multiplies by the norm's weight in its place), at most MULTI_MAX of them. Other readers of the norm's
output (none in the supported architectures) keep reading `quasar::rms_norm`.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from quasar_hf import compat
from quasar_hf.ops.hadamard import HadamardRotation

_W8A8 = "quasar::w8a8_linear"
_RMS_NORM = "quasar::rms_norm"
_FOLDED = "quasar::w8a8_folded_norm_linears"
_ATTENTION = "quasar::rowstable_attention_cpu"
_LM_HEAD = "quasar::rowstable_linear"
_HADAMARD = "quasar::hadamard_rows"


def _op_name(node: torch.fx.Node) -> str | None:
    target = node.target
    return target.name() if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) else None


def _foldable_consumer(node: torch.fx.Node, norm: torch.fx.Node) -> bool:
    """A `quasar::w8a8_linear(norm, ...)` that the fold computes exactly as eager's group does."""
    if _op_name(node) != _W8A8 or len(node.args) != 7 or node.kwargs:
        return False
    x, _, _, _, act_prescale, packed, backend = node.args
    return x is norm and act_prescale is None and backend == "cpu_fused" and bool(packed)


def fold_group(graph: torch.fx.Graph, norm: torch.fx.Node) -> int:
    """Rewrite one `quasar::rms_norm` node and its foldable consumers; returns how many linears it folded."""
    from quasar_hf.ops.cpu_fused_multi import MULTI_MAX

    if len(norm.args) != 5 or norm.kwargs:
        return 0
    x, weight, eps, offset, _ = norm.args
    linears = [user for user in norm.users if _foldable_consumer(user, norm)][:MULTI_MAX]
    if not linears:
        return 0
    args = (
        x,
        weight,
        eps,
        offset,
        [lin.args[1] for lin in linears],
        [lin.args[2] for lin in linears],
        [lin.args[3] for lin in linears],
        [p for lin in linears for p in lin.args[5]],
        "cpu_fused",
    )
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min(linears, key=order.__getitem__)
    inputs: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, inputs.append)
    if any(order[n] >= order[first] for n in inputs):
        return 0  # a weight defined after the first consumer (not how Dynamo lays out graphs): leave it
    with graph.inserting_before(first):
        fused = graph.call_function(torch.ops.quasar.w8a8_folded_norm_linears.default, args)
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


def _out_features(weight: torch.fx.Node | torch.Tensor) -> int:
    """Rows of a weight: of its graph node, or of its fake value."""
    return int((weight.meta["val"] if isinstance(weight, torch.fx.Node) else weight).shape[0])


def _cpu_float(arg: object) -> bool:
    """True for a graph node whose value is a CPU float32/bfloat16 tensor (what the C kernels take)."""
    value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype in (torch.float32, torch.bfloat16)


def _has_native_twin(name: str | None, args: tuple) -> bool:
    """True for a CPU kernel op whose arguments the native twin takes (ops/native.py's table); the
    ops that run on any device (lm_head, RMSNorm, rotation) only on CPU float rows."""
    if name == _W8A8:
        return len(args) == 7 and args[6] == "cpu_fused" and len(args[5]) == 2
    if name == _FOLDED:
        return len(args) == 9 and args[8] == "cpu_fused" and len(args[7]) == 2 * len(args[4])
    if name == _LM_HEAD:
        return len(args) == 3 and _cpu_float(args[0]) and _cpu_float(args[1]) and (args[2] is None or _cpu_float(args[2]))
    if name == _RMS_NORM:
        return len(args) == 5 and _cpu_float(args[0]) and _cpu_float(args[1])
    if name == _HADAMARD:
        return len(args) == 5 and _cpu_float(args[0]) and isinstance(args[1], torch.fx.Node)  # signs: a tensor
    return name == _ATTENTION and len(args) == 5


def _native_args(name: str, args: tuple) -> tuple:
    """The native twin's arguments for op `name` called with `args`: graph nodes, or their fake values
    (Inductor lowers a custom op against `eager_input_vals`, whose non-tensor entries are None)."""
    if name == _W8A8:
        x, weight_q, weight_scale, bias, act_prescale, packed, _ = args
        return (x, *packed, weight_scale, bias, act_prescale, _out_features(weight_q))
    if name == _FOLDED:
        x, weight, eps, offset, weight_q, weight_scale, bias, packed, _ = args
        sizes = [_out_features(w) for w in weight_q]
        return (x, weight, eps, offset, list(packed[0::2]), list(packed[1::2]), weight_scale, bias, sizes)
    if name == _HADAMARD:
        x, signs, blocks, odd_order, pow2 = args
        size = blocks * odd_order * pow2 if None not in (blocks, odd_order, pow2) else None
        scale = HadamardRotation(size, blocks, odd_order, pow2).scale if size is not None else None
        return (x, signs, blocks, pow2, scale)
    return tuple(args)


_NATIVE_TWINS = {
    _W8A8: "native_w8a8_linear",
    _FOLDED: "native_folded_norm_linears",
    _ATTENTION: "native_rowstable_attention",
    _LM_HEAD: "native_rowstable_linear",
    _RMS_NORM: "native_rms_norm",
    _HADAMARD: "native_hadamard_rows",
}


def use_native_ops(graph: torch.fx.Graph) -> int:
    """Point each CPU op that has a C++-registered twin (ops/native.py) at it; returns how many."""
    count = 0
    for node in list(graph.nodes):
        name = _op_name(node)
        if node.kwargs or not _has_native_twin(name, node.args):
            continue
        node.target = getattr(torch.ops.quasar, _NATIVE_TWINS[name]).default
        node.args = _native_args(name, node.args)
        eager = node.meta.get("eager_input_vals")
        if eager is not None:
            node.meta["eager_input_vals"] = (_native_args(name, eager[0]), {})
        count += 1
    return count


class FoldNormsIntoW8A8Linears(CustomGraphPass):
    """Post-grad pass: each RMSNorm feeding W8A8 linears becomes one folded op (see the module docstring),
    then, with `native` (where the native library is had: `native.is_available()`, built at the first
    compile), every CPU kernel op calls its C++-registered twin. native=False keeps the Python ops
    (the same bits; for comparisons)."""

    def __init__(self, native: bool = True) -> None:
        self.native = native

    def __eq__(self, other: object) -> bool:  # equal configs share one compiled step (CompileConfig compares options)
        return type(other) is type(self) and other.native == self.native

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.native))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(native={self.native})"

    def _use_native(self) -> bool:
        from quasar_hf.ops import native

        return self.native and native.is_available()

    def __call__(self, graph: torch.fx.Graph) -> None:
        for norm in [node for node in graph.nodes if _op_name(node) == _RMS_NORM]:
            fold_group(graph, norm)
        if self._use_native():
            use_native_ops(graph)
        graph.lint()

    def uuid(self) -> bytes:
        """Inductor's cache key: these sources, and whether the native ops are used."""
        from quasar_hf.ops import cpu_fused_multi, native, torch_ops

        files = (__file__, torch_ops.__file__, cpu_fused_multi.__file__, native.__file__, str(native.SOURCE))
        return get_hash_for_files(files, extra="native" if self._use_native() else "python")


def compile_config(device: torch.device) -> object:
    """What `quasar={"compile": True}` compiles a step with: `compat.default_compile_config`, plus on CPU
    (where the pass's ops run) `FoldNormsIntoW8A8Linears`."""
    cpu = torch.device(device).type != "cuda"
    return compat.default_compile_config(device, FoldNormsIntoW8A8Linears() if cpu else None)
