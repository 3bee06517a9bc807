"""warm_up (speculative/warm_up.py): after it, compiled generate meets no new graph on any length or batch
size inside its buckets, stays exact; a second process loads the steps' traced code instead of tracing and
still recompiles when it must; a damaged on-disk bundle or a failing loaded step is rebuilt rather than used."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from quasar_hf import compat
from quasar_hf.speculative import compiled_steps, step_compiler
from quasar_hf.speculative.left_padding import left_padded
from quasar_hf.speculative.warm_up import warm_up
from tests.helpers.compiled_steps import AOT_EAGER
from tests.helpers.prompts import repeating_prompt
from tests.helpers.tiny_models import quasar_model

needs_kernels = pytest.mark.kernels("rowstable_linear", "attention")


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


def as_if_a_new_process(model) -> None:
    """Forget what this process compiled and recorded (torch's disk caches stay): a later warm_up meets them as a new
    process would."""
    from torch._dynamo.precompile_context import PrecompileContext
    from torch.compiler._cache import CacheArtifactManager

    torch._dynamo.reset()
    CacheArtifactManager.clear()
    PrecompileContext.clear()
    model.__dict__.pop(compiled_steps.TABLE_ATTR, None)


def bundle_is_whole(path: Path) -> bool:
    record = json.loads(path.with_suffix(".json").read_text())
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == record["sha256"]


@needs_kernels
def test_a_damaged_or_missing_bundle_is_rewritten_even_while_torchs_caches_hold_the_steps(tmp_path, monkeypatch):
    """The real compile path (Inductor), with torch's caches in a folder of the test's own. The bundle is saved with its
    SHA-256; a flipped byte is reported, deleted and replaced by a whole bundle, though torch's own caches still hold
    every step (nothing to compile, so torch records nothing unless the steps are traced again); a new cache folder is
    filled the same way; and such a bundle alone (torch's caches emptied) brings back the steps: nothing is traced."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch_caches"))
    model = quasar_model(tmp_path, "llama", torch.float32)
    folder = tmp_path / "compiled"
    as_if_a_new_process(model)
    first = warm_up(model, batch_sizes=(1,), max_length=64, cache_folder=folder, progress=False)
    assert first.cache == "missing" and first.cache_file is not None and first.graphs_compiled == 2
    bundle = Path(first.cache_file)
    record = json.loads(bundle.with_suffix(".json").read_text())
    assert record["bytes"] > 0 and bundle_is_whole(bundle)
    data = bytearray(bundle.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bundle.write_bytes(bytes(data))
    as_if_a_new_process(model)
    second = warm_up(model, batch_sizes=(1,), max_length=64, cache_folder=folder, progress=False)
    assert second.cache.startswith("rebuilt") and "SHA-256" in second.cache
    assert bundle_is_whole(bundle) and bundle.read_bytes() != bytes(data)
    as_if_a_new_process(model)
    other = warm_up(model, batch_sizes=(1,), max_length=64, cache_folder=tmp_path / "other", progress=False)
    assert other.cache == "missing" and bundle_is_whole(Path(other.cache_file))
    as_if_a_new_process(model)
    shutil.rmtree(tmp_path / "torch_caches")
    third = warm_up(model, batch_sizes=(1,), max_length=64, cache_folder=tmp_path / "other", progress=False)
    assert third.cache == "loaded" and third.graphs_compiled == 0
    ids = repeating_prompt(3, 20)
    out = model.generate(ids, max_new_tokens=8, do_sample=False, quasar={"compile": True})
    assert torch.equal(
        out, model.generate(ids, max_new_tokens=8, do_sample=False, quasar={"compile": True, "num_draft_tokens": 0})
    )
    torch._dynamo.reset()


def test_a_bundle_torch_cannot_read_is_discarded_not_loaded(tmp_path):
    """Bytes that match their recorded SHA-256 but are no bundle of torch's (load_cache_artifacts returns None, having
    loaded nothing) are deleted and reported, not "loaded"."""
    from quasar_hf.speculative.warm_up import load_bundle

    bundle = tmp_path / "model.bin"
    garbage = b"not a bundle of torch's" * 8
    bundle.write_bytes(garbage)
    bundle.with_suffix(".json").write_text(json.dumps({"sha256": hashlib.sha256(garbage).hexdigest()}))
    status = load_bundle(bundle)
    assert status.startswith("rebuilt") and "torch could not read it" in status
    assert not bundle.exists() and not bundle.with_suffix(".json").exists()


@needs_kernels
def test_warm_up_does_not_say_it_compiles_inside_a_call_and_a_call_does(tmp_path, monkeypatch, caplog):
    """The "compiling steps ... in this call" line is for a compile inside generate; warm_up's own compiles are
    announced by warm_up's summary. Steps run eagerly here: what is checked is who says what."""

    def eager_step(model, config, name, precompile=False, reuse_disk=True):
        step = lambda *args, **kwargs: model(*args, **kwargs)  # noqa: E731
        step.loaded_from_disk = False
        return step

    monkeypatch.setattr(step_compiler, "compiled_step", eager_step)
    model = quasar_model(tmp_path, "llama", torch.float32)
    with caplog.at_level("INFO", logger="quasar_hf"):
        report = warm_up(model, batch_sizes=(1,), max_length=64, compile_config=AOT_EAGER, cache_folder=None, progress=False)
    assert report.shapes == [(1, 512)] and "in this call" not in caplog.text and "compiled steps for batch" in caplog.text
    ids, mask = left_padded([repeating_prompt(seed, 12) for seed in range(2)])
    with caplog.at_level("INFO", logger="quasar_hf"):
        compiled(model, ids, mask, 4, AOT_EAGER)
    assert "compiling steps for 2 rows x 512 cache slots in this call" in caplog.text


WARM_PROCESS = """
import json, sys, torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM
import quasar_hf
from tests.helpers.prompts import repeating_prompt
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
report = quasar_hf.warm_up(model, batch_sizes=(1,), max_length=64, cache_folder=sys.argv[2], progress=False)
ids = repeating_prompt(5, 24)
run = lambda **q: model.generate(ids, max_new_tokens=12, do_sample=False, quasar={"compile": True, **q})[0].tolist()
graphs = int(counters["stats"]["unique_graphs"])
out = {"cache": report.cache, "graphs": report.graphs_compiled, "quasar": run(), "plain": run(num_draft_tokens=0)}
out["graphs_after"] = int(counters["stats"]["unique_graphs"]) - graphs
out["width_2"] = run(num_draft_tokens=2)  # a draft width warm_up did not compile: one more trace, in a loaded step
out["graphs_width_2"] = int(counters["stats"]["unique_graphs"]) - graphs
print("RESULT " + json.dumps(out))
"""


def run_warm_process(checkpoint: Path, folder: Path, caches: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(caches), "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", WARM_PROCESS, str(checkpoint), str(folder)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("RESULT ", 1)[1])


@needs_kernels
@pytest.mark.slow
@pytest.mark.skipif(not compat.precompile_supported(), reason="this torch cannot keep Dynamo's traced code on disk")
def test_a_second_process_loads_the_traced_steps_and_still_recompiles_what_is_new(tmp_path):
    """Two processes, same checkpoint and cache folder: the second traces nothing in warm_up, gives the first's
    tokens, and a new draft width still compiles in it (a trace inside a step whose code was loaded)."""
    checkpoint = tmp_path / "w8a8"
    quasar_model(tmp_path, "llama", torch.float32).save_pretrained(checkpoint)
    first = run_warm_process(checkpoint, tmp_path / "compiled", tmp_path / "torch_caches")
    second = run_warm_process(checkpoint, tmp_path / "compiled", tmp_path / "torch_caches")
    assert (first["cache"], first["graphs"]) == ("missing", 2)
    assert (second["cache"], second["graphs"], second["graphs_after"]) == ("loaded", 0, 0)
    for run in (first, second):
        assert run["quasar"] == run["plain"] == first["plain"] and run["width_2"] == run["plain"]
        assert run["graphs_width_2"] == 1


def test_a_loaded_step_that_fails_is_deleted_and_compiled_afresh(monkeypatch):
    """Mechanics of CompiledSteps.call: a step loaded from disk that raises is discarded (its entry deleted),
    compiled again without the disk cache, and the call runs on the fresh one; a fresh step's error is raised."""
    made, discarded = [], []

    def fake_compiled_step(model, config, name, precompile=False, reuse_disk=True):
        def step(x):
            if step.loaded_from_disk:
                raise NameError("___module_collections_1_c0")
            return x + 1

        step.loaded_from_disk = precompile
        made.append((name, precompile))
        return step

    monkeypatch.setattr(step_compiler, "compiled_step", fake_compiled_step)
    monkeypatch.setattr(step_compiler, "discard_precompiled", discarded.append)
    monkeypatch.setattr(compiled_steps, "decide_kernels", lambda device: None)
    table = compiled_steps.CompiledSteps(torch.nn.Linear(2, 2), AOT_EAGER)
    table.cache_key = "ab" * 32
    assert table.step_for(1, 512)(1) == 2
    assert made == [("quasar_step_abababababababab_b1_s512", True), ("quasar_step_abababababababab_b1_s512_fresh", False)]
    assert len(discarded) == 1 and table.failed_loads == 1
    assert table.step_for(1, 512)(2) == 3 and len(made) == 2  # the fresh step stays
    table.steps[(1, 512)] = lambda x: [][x]  # not loaded from disk: its error is the caller's
    with pytest.raises(IndexError):
        table.call((1, 512), 0)


def test_trace_afresh_traces_again_only_the_steps_torch_has_not_recorded_here(monkeypatch):
    """Mechanics of CompiledSteps.trace_afresh: a step loaded from torch's disk cache is replaced by one traced here
    (its disk entry deleted first: reuse_disk=False); a step this process traced with its code kept stays."""
    made = []

    def fake_compiled_step(model, config, name, precompile=False, reuse_disk=True):
        step = lambda x: x  # noqa: E731
        step.loaded_from_disk = precompile and reuse_disk  # torch's disk cache holds every step here
        made.append((precompile, reuse_disk))
        return step

    monkeypatch.setattr(step_compiler, "compiled_step", fake_compiled_step)
    monkeypatch.setattr(compiled_steps, "decide_kernels", lambda device: None)
    table = compiled_steps.CompiledSteps(torch.nn.Linear(2, 2), AOT_EAGER)
    table.cache_key = "ab" * 32
    table.step_for(1, 512)
    assert made == [(True, True)] and table.recorded == set()
    table.trace_afresh([(1, 512), (2, 512)])
    table.step_for(1, 512)
    table.step_for(2, 512)
    assert made[1:] == [(True, False), (True, False)] and table.recorded == {(1, 512), (2, 512)}
    table.trace_afresh([(1, 512)])
    table.step_for(1, 512)
    assert len(made) == 3


def test_a_bundle_torch_cannot_save_is_a_warning_not_an_error(tmp_path, monkeypatch, caplog):
    """Saving writes the steps' traced code to torch's own cache first; when that fails (a read-only /tmp),
    warm_up's steps are still compiled: the save is skipped with a warning naming torch's error."""
    from quasar_hf.speculative import warm_up as warm_up_module

    def unwritable():
        raise RuntimeError("Failed to save package to /tmp/torchinductor_x/dynamo/ab: [Errno 30] Read-only file system")

    monkeypatch.setattr(step_compiler, "save_compile_artifacts", unwritable)
    bundle = tmp_path / "compiled" / "model.bin"
    with caplog.at_level("WARNING"):
        warm_up_module.save_bundle(bundle)
    assert not bundle.exists() and "Read-only file system" in caplog.text


def test_the_cache_key_changes_with_the_source_and_transformers(tmp_path, monkeypatch):
    """Traced steps run quasar_hf's and Transformers' code: an edited tree under the same version number, or
    another Transformers, must not load the steps another one traced."""
    package = Path(compiled_steps.__file__).resolve().parents[1]
    copy = tmp_path / "quasar_hf"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    assert compiled_steps.source_digest(copy) == compiled_steps.source_digest()
    loop = copy / "speculative" / "loop.py"
    loop.write_text(loop.read_text() + "\n# an edit\n")
    assert compiled_steps.source_digest(copy) != compiled_steps.source_digest()

    from transformers import CompileConfig

    from tests.helpers.tiny_models import tiny_model

    model, config = tiny_model(), CompileConfig(fullgraph=True)
    key = compiled_steps.compile_cache_key(model, config)
    assert compiled_steps.compile_cache_key(model, config) == key
    transformers = sys.modules["transformers"]  # the module `import transformers` finds now (it may replace itself)
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".other")
    assert compiled_steps.compile_cache_key(model, config) != key
    monkeypatch.setattr(compiled_steps, "source_digest", lambda root=None: "edited")
    assert compiled_steps.compile_cache_key(model, config) != key
