"""Our ops per decoder layer in a compiled step's graph, per W8A8 backend, for one source tree.

A tiny random Llama (hidden 64, 4 layers, SmolLM2's tokenizer) is quantized with QuasarConfig on
the backend given, compiled as `quasar={"compile": True}` compiles it for the device the backend
serves ("cpu_fused": the CPU config; "triton": the CUDA config, run here in Triton's interpreter),
and Inductor's post-grad graph of a 6-token verify step is read: every `quasar::` op call, and the
norms and W8A8 GEMMs among them, divided by the layer count. A graph pass that the tree's config
installs runs first (the count is of what the step calls). Each W8A8 op is one C call on CPU; on
CUDA the Triton linear launches 2 kernels per call (quantize, GEMM) or 3 (split-K reduce).

    python -m benchmarks graph-ops --out OUT.json        (per tree: PYTHONPATH=TREE python benchmarks/speed/graph_ops.py --out ...)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # "triton" on CPU: its interpreter, set before Triton loads

from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402

LAYERS = 4


class _Count(CustomGraphPass):
    """Inductor's post-grad slot: the tree's own pass first (if any), then count the quasar ops."""

    def __init__(self, inner=None) -> None:
        self.inner, self.counts = inner, []

    def __call__(self, graph) -> None:
        if self.inner is not None:
            self.inner(graph)
        targets = (str(n.target) for n in graph.nodes if n.op == "call_function")
        self.counts.append(collections.Counter(t.split(".")[1] for t in targets if t.startswith("quasar.")))

    def uuid(self) -> bytes:
        return repr(self.inner).encode()


def _compile_config(device: str):
    try:  # a tree whose compiled CPU steps need a graph pass names its config there
        from quasar_hf.ops.graph_passes import compile_config
    except ImportError:
        from quasar_hf.compat import default_compile_config as compile_config
    return compile_config(torch.device(device))


def count(backend: str) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from quasar_hf import QuasarConfig
    from quasar_hf.models import smollm2_135m_instruct

    device = "cuda" if backend == "triton" else "cpu"
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512)  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        quasar = QuasarConfig(num_calibration_samples=4, calibration_seq_len=32, weight_rounding="nearest", backend=backend,
                              tokenizer=smollm2_135m_instruct())  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quasar).eval()
    where = device if torch.device(device).type == "cpu" or torch.cuda.is_available() else "cpu"  # else: interpreted
    model = model.to(where)
    options = dict(_compile_config(device).options)
    options.pop("triton.cudagraphs", None)  # the graph, not its replay: CUDA graphs need a GPU
    counter = _Count(options.get("post_grad_custom_post_pass"))
    options["post_grad_custom_post_pass"] = counter
    torch._dynamo.reset()
    step = torch.compile(model.forward, fullgraph=True, dynamic=False, options=options)
    with torch.no_grad(), torch._inductor.utils.fresh_cache():
        step(input_ids=torch.randint(0, 1000, (1, 6), device=where))
    graph = counter.counts[-1]
    calls = sum(graph.values())
    gemms = sum(c for name, c in graph.items() if name.startswith("w8a8"))
    return {
        "backend": backend,
        "layers": LAYERS,
        "ops": dict(sorted(graph.items())),
        "ops_per_layer": calls / LAYERS,
        "w8a8_calls_per_layer": gemms / LAYERS,
        "norm_calls_per_layer": graph.get("rms_norm", 0) / LAYERS,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["cpu_fused", "triton"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import quasar_hf

    rows = [count(backend) for backend in args.backends]
    from quasar_hf.bench.report import environment  # machine, versions, threads, load, commit

    result = {
        "command": "python -m benchmarks graph-ops " + " ".join(sys.argv[2:] if argv is None else argv),
        "tree": os.path.dirname(os.path.dirname(os.path.abspath(quasar_hf.__file__))),
        "environment": environment(),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    for row in rows:
        print(row["backend"], row["ops_per_layer"], row["w8a8_calls_per_layer"], row["norm_calls_per_layer"], row["ops"])


if __name__ == "__main__":  # also runnable as a file, against another tree's quasar_hf on PYTHONPATH
    main()
