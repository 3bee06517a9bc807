"""nn/weight_bytes.py: the bytes a decode step reads (every floor's numerator) and a module's bytes."""

from __future__ import annotations

import torch

from quasar_hf.nn import NormFoldedW8A8Linear, W8A8Linear
from quasar_hf.nn.weight_bytes import module_bytes, step_read_bytes, step_weight_bytes
from tests.helpers.tiny_models import quasar_model, tiny_model


def test_a_quasar_step_reads_its_int8_weights_and_its_float_lm_head_once(tmp_path):
    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    assert any(isinstance(m, NormFoldedW8A8Linear) for m in model.modules())  # stacked weights, each once
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_key_value_heads * head_dim * config.hidden_size
    per_layer = config.hidden_size**2 * 2 + kv + 3 * config.hidden_size * config.intermediate_size  # q, o, k+v, MLP
    lm_head = config.vocab_size * config.hidden_size * 2  # bf16
    assert step_weight_bytes(model) == {"int8": config.num_hidden_layers * per_layer, "float": lm_head}
    assert step_read_bytes(model) == config.num_hidden_layers * per_layer + lm_head
    int8 = sum(m.weight.numel() for m in model.modules() if isinstance(m, W8A8Linear))
    assert step_read_bytes(model) == int8 + model.lm_head.weight.numel() * 2  # the floor the benchmarks used


def test_a_float_model_reads_every_linear_weight_and_holds_all_its_tensors():
    model = tiny_model("llama", dtype=torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert step_weight_bytes(model) == {"int8": 0, "float": sum(m.weight.numel() * 2 for m in linears)}
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    assert module_bytes(model) == held > step_read_bytes(model)
