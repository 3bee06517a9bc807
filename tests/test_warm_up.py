"""warm_up (speculative/warm_up.py): after it, compiled generate meets no new graph on any length or batch
size inside its buckets, stays exact, and a damaged on-disk bundle is rebuilt rather than used."""

from __future__ import annotations

import hashlib
import json

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from quasar_hf.speculative import compiled_steps
from quasar_hf.speculative.warm_up import warm_up
from tests.test_static_steps import AOT_EAGER, left_padded, needs_kernels, quasar_model, repeating_prompt


def graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def compiled(model, ids, mask, new_tokens, config, **quasar):
    options = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return model.generate(ids, quasar={"compile": config, **quasar}, **options)


@needs_kernels
def test_a_warmed_model_compiles_nothing_on_new_lengths_or_batch_sizes_and_stays_exact(tmp_path):
    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    torch._dynamo.reset()
    report = warm_up(model, batch_sizes=(1, 2, 3), compile_config=AOT_EAGER, cache_folder=None, progress=False)
    assert report.shapes == [(1, 512), (2, 512), (4, 512)] and report.graphs_compiled == 6
    before = graphs()
    with torch.no_grad():
        for size, length, new_tokens in [(1, 7, 9), (1, 40, 30), (2, 13, 12), (3, 22, 20), (1, 150, 200), (4, 9, 5)]:
            ids, mask = left_padded([repeating_prompt(seed, length + seed) for seed in range(size)])
            plain = compiled(model, ids, mask, new_tokens, AOT_EAGER, num_draft_tokens=0)
            assert torch.equal(compiled(model, ids, mask, new_tokens, AOT_EAGER), plain), (size, length)
    assert graphs() == before, "no graph after warm-up"
    assert compiled_steps.compiled_steps_for(model, AOT_EAGER).compiled_keys == 3
    torch._dynamo.reset()


@needs_kernels
def test_a_damaged_bundle_on_disk_is_rebuilt_never_used(tmp_path):
    """The real compile path (Inductor): the bundle is saved with its SHA-256; a flipped byte is reported,
    deleted and replaced by a good one, and the steps still compile and run."""
    model = quasar_model(tmp_path, "llama", torch.float32)
    folder = tmp_path / "compiled"
    torch._dynamo.reset()
    first = warm_up(model, batch_sizes=(1,), max_length=64, cache_folder=folder, progress=False)
    assert first.cache == "missing" and first.cache_file is not None
    bundle = folder / first.cache_file.rsplit("/", 1)[-1]
    record = json.loads(bundle.with_suffix(".json").read_text())
    data = bytearray(bundle.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bundle.write_bytes(bytes(data))
    torch._dynamo.reset()
    del model.__dict__[compiled_steps.TABLE_ATTR]
    second = warm_up(model, batch_sizes=(1,), max_length=64, cache_folder=folder, progress=False)
    assert second.cache.startswith("rebuilt") and "SHA-256" in second.cache and second.graphs_compiled == 2
    rewritten = json.loads(bundle.with_suffix(".json").read_text())
    assert hashlib.sha256(bundle.read_bytes()).hexdigest() == rewritten["sha256"] != hashlib.sha256(data).hexdigest()
    assert record["bytes"] > 0
    torch._dynamo.reset()
    del model.__dict__[compiled_steps.TABLE_ATTR]
    third = warm_up(model, batch_sizes=(1,), max_length=64, cache_folder=folder, progress=False)
    assert third.cache == "loaded"
    ids = repeating_prompt(3, 20)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, quasar={"compile": True})
    assert out.shape == (1, 28)
    torch._dynamo.reset()
