"""The static KV cache and compiled steps of the speculative loop (speculative/static_cache.py).

* Eager over the static cache: rollback moves a length, stale slots are masked, so greedy and
  seeded sampling give exactly the tokens of plain (dynamic-cache) decoding.
* Compiled (`quasar={"compile": ...}`): greedy `quasar=True` equals plain greedy decoding with the
  same compiled step (`num_draft_tokens=0`), token for token; two graphs (decode, padded verify),
  and no recompiles once warm, for other prompts and lengths within one cache size.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers import CompileConfig

from quasar_hf import speculative_generate
from quasar_hf.ops import native
from quasar_hf.ops.rowstable_attention import _visible_keys
from quasar_hf.speculative import static_cache
from quasar_hf.speculative.left_padding import left_padded
from quasar_hf.speculative.static_cache import StaticCacheBuffer, StaticVerifierCache, static_cache_slots
from tests.helpers.compiled_steps import AOT_EAGER
from tests.helpers.prompts import repeating_prompt
from tests.helpers.tiny_models import quasar_model, tiny_model

needs_kernels = pytest.mark.kernels("rowstable_linear", "attention")


def greedy(model, prompt, quasar=None, new_tokens: int = 24) -> torch.Tensor:
    if quasar is None:
        return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, quasar=False)
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, quasar=quasar, return_dict_in_generate=True)
    return out.sequences, out.quasar_stats


@needs_kernels
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen3", torch.bfloat16), ("gemma3", torch.bfloat16)])
def test_eager_static_cache_gives_the_tokens_of_plain_greedy(tmp_path, arch, dtype):
    """Gemma 3's sliding layers become full static layers (its window mask still applies)."""
    model, assistant = quasar_model(tmp_path, arch, dtype, with_source=True)
    accepted = {"ngram": 0, "assistant": 0}
    for seed in range(2):
        prompt = repeating_prompt(seed)
        plain = greedy(model, prompt)
        for name, extra in (("ngram", {}), ("assistant", {"assistant_model": assistant})):
            tokens, stats = greedy(model, prompt, {"cache_implementation": "static", **extra})
            assert torch.equal(tokens, plain), f"{arch} seed {seed} {name}"
            accepted[name] += stats.accepted_tokens
    assert min(accepted.values()) > 0, f"rollback and acceptance both exercised: {accepted}"


@needs_kernels
def test_generate_cache_implementation_static_runs_the_static_cache(tmp_path, monkeypatch):
    model = quasar_model(tmp_path, "llama", torch.float32)
    calls = []
    forward = StaticVerifierCache.forward
    monkeypatch.setattr(StaticVerifierCache, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    prompt = repeating_prompt(0)
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, quasar=True, cache_implementation="static")
    assert calls and torch.equal(out, greedy(model, prompt, new_tokens=12))


@needs_kernels
def test_seeded_sampling_over_the_static_cache_equals_the_dynamic_cache(tmp_path):
    """Same bits in the cache and logits, same generator: the same sampled tokens, draft for draft."""
    model = quasar_model(tmp_path, "llama", torch.float32)
    prompt = repeating_prompt(1)
    runs = []
    for cache in ("dynamic", "static"):
        out = model.generate(
            prompt,
            max_new_tokens=20,
            do_sample=True,
            top_k=8,
            quasar={"cache_implementation": cache},
            quasar_generator=torch.Generator().manual_seed(5),
        )
        runs.append(out)
    assert torch.equal(*runs)


@needs_kernels
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen3", torch.bfloat16), ("gemma3", torch.bfloat16)])
def test_compiled_quasar_equals_compiled_plain_greedy(tmp_path, arch, dtype):
    model = quasar_model(tmp_path, arch, dtype)
    torch._dynamo.reset()
    with torch.no_grad():
        accepted = 0
        for seed in range(2):
            prompt = repeating_prompt(seed)
            plain, _ = greedy(model, prompt, {"compile": AOT_EAGER, "num_draft_tokens": 0})
            tokens, stats = greedy(model, prompt, {"compile": AOT_EAGER})
            assert torch.equal(tokens, plain), f"{arch} seed {seed}"
            accepted += stats.accepted_tokens
    torch._dynamo.reset()
    assert accepted > 0


@needs_kernels
def test_inductor_steps_are_exact_two_graphs_and_never_recompile_once_warm(tmp_path):
    """Inductor's C++ code (bf16, q/k norms): exactness, two graphs, then other prompts and lengths
    of the same cache size under error_on_recompile."""
    model = quasar_model(tmp_path, "qwen3", torch.bfloat16)
    compiled = {"compile": True}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    prompt = repeating_prompt(0)
    plain, _ = greedy(model, prompt, {**compiled, "num_draft_tokens": 0})
    tokens, stats = greedy(model, prompt, compiled)
    assert stats.accepted_tokens > 0 and torch.equal(tokens, plain)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 2, "one graph per step shape: decode [1, 1] and verify [1, k+1]"
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed, length, new in ((1, 22, 30), (2, 40, 16)):
            prompt = repeating_prompt(seed, length)
            tokens, _ = greedy(model, prompt, compiled, new)
            assert torch.equal(tokens, greedy(model, prompt, {**compiled, "num_draft_tokens": 0}, new)[0])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_rollback_moves_the_length_and_sizes_round_up():
    model = tiny_model().eval()
    cache = StaticVerifierCache(model, 1, torch.device("cpu"), static_cache_slots(40))
    assert cache.max_cache_len == static_cache.CACHE_SLOTS_STEP
    with torch.no_grad():
        cache.forward(repeating_prompt(0, 10), last_only=True)
        cache.forward(torch.tensor([[1, 2, 3, 4]]))
        cache.keep_accepted(torch.tensor([2]), 4)  # pending token + 1 accepted draft kept
        assert cache.length == 12 and int(cache.valid_len) == 12 and int(cache.slot_mask.sum()) == 12
        cache.drop_last_tokens(torch.tensor([1]))
        assert cache.length == 11 and int(cache.valid_len) == 11
        with pytest.raises(RuntimeError, match="cannot take"):
            cache.forward(torch.zeros(1, cache.max_cache_len, dtype=torch.long))


def test_a_reused_cache_gives_the_logits_of_a_fresh_one():
    """Compiled steps keep a call's KV cache for the next call of that shape: the cache is cleared of every
    slot the last call wrote, so the next call reads what a new cache would give it."""
    model = tiny_model().eval()
    slots = static_cache_slots(40)
    kv = StaticCacheBuffer.fresh(model, slots)
    with torch.no_grad():
        first = StaticVerifierCache(model, 1, torch.device("cpu"), slots, kv=kv)
        first.forward(repeating_prompt(5, 36), last_only=True)
        first.forward(torch.tensor([[7, 8, 9]]))
        assert kv.written == 39
        reused = StaticVerifierCache(model, 1, torch.device("cpu"), slots, kv=kv)
        assert kv.written == 0 and reused.cache is kv.cache
        assert all(not layer.keys.any() and not layer.values.any() for layer in kv.cache.layers)
        fresh = StaticVerifierCache(model, 1, torch.device("cpu"), slots)
        for tokens in (repeating_prompt(1, 12), torch.tensor([[3, 4]])):
            assert torch.equal(reused.forward(tokens), fresh.forward(tokens))


@needs_kernels
def test_a_left_padded_long_prefill_into_a_static_cache_gives_each_row_its_own_logits(tmp_path):
    """A batch's prompt past the kernel's rows, left-padded, into an empty static cache: each row's last
    logits are those of the prompt alone, in a one-row static cache (what a served request meets alone)
    and in a dynamic cache: the cache's unwritten slots are left out, each row runs SDPA on its own tokens."""
    model = quasar_model(tmp_path, "llama", torch.float32)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (1, n), generator=generator) for n in (100, 80)]
    ids, mask = left_padded(prompts)
    slots = static_cache_slots(120)
    with torch.no_grad():
        batched = StaticVerifierCache(model, 2, torch.device("cpu"), slots).forward(ids, mask, last_only=True)[:, -1]
        for row, prompt in enumerate(prompts):
            alone = StaticVerifierCache(model, 1, torch.device("cpu"), slots).forward(prompt, last_only=True)[0, -1]
            assert torch.equal(batched[row], alone), f"row {row} against its prompt alone in a static cache"
            assert torch.equal(alone, model(prompt).logits[0, -1].float()), f"row {row} against a dynamic cache"


@needs_kernels
def test_a_batch_over_the_static_cache_equals_plain_batched_greedy(tmp_path):
    """Rows accept different counts (masked slots), one stops early at eos (it idles in the batch)."""
    model, assistant = quasar_model(tmp_path, "llama", torch.float32, with_source=True)
    ids, mask = left_padded([repeating_prompt(0, 30), repeating_prompt(1, 12), repeating_prompt(2, 20)])
    free = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None, quasar=False)
    eos = int(free[1, ids.shape[1] + 4])  # row 1's 5th new token
    plain = model.generate(
        ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=0, quasar=False
    )
    for extra in ({}, {"assistant_model": assistant}):
        quasar = {"cache_implementation": "static", **extra}
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
            quasar=quasar,
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, plain), extra.keys()
        assert out.quasar_stats.accepted_tokens > 0


@needs_kernels
def test_a_compiled_batch_keeps_its_graphs_when_rows_finish(tmp_path):
    """Finished rows idle in the batch: [B, 1] and [B, k+1] graphs only, no recompiles; tokens = compiled plain."""
    model = quasar_model(tmp_path, "llama", torch.bfloat16)
    ids, mask = left_padded([repeating_prompt(3, 26), repeating_prompt(4, 14)])
    compiled = {"compile": AOT_EAGER, "num_draft_tokens": 4}
    options = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    free = model.generate(ids, quasar={**compiled, "num_draft_tokens": 0}, eos_token_id=None, **options)
    eos = int(free[1, ids.shape[1] + 3])
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.generate(ids, quasar=compiled, eos_token_id=None, **options)  # warm: both graphs
    with torch._dynamo.config.patch(error_on_recompile=True):
        plain = model.generate(ids, quasar={**compiled, "num_draft_tokens": 0}, eos_token_id=eos, **options)
        spec = model.generate(ids, quasar=compiled, eos_token_id=eos, **options)
    assert torch.equal(spec, plain)
    new_tokens = spec[:, ids.shape[1] :]
    stop = int((new_tokens[1] == eos).nonzero()[0])
    assert stop < new_tokens.shape[1] - 1 and not (new_tokens[0, : stop + 1] == eos).any(), "row 1 stops first"
    assert bool((new_tokens[1, stop + 1 :] == 0).all()), "and idles, padded, while row 0 goes on"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    torch._dynamo.reset()


@needs_kernels
def test_a_sliding_window_batch_is_refused_over_the_static_cache(tmp_path):
    model = quasar_model(tmp_path, "gemma3", torch.float32)
    ids, mask = left_padded([repeating_prompt(0, 12), repeating_prompt(1, 8)])
    with pytest.raises(ValueError, match="batch size 1"):
        model.generate(ids, attention_mask=mask, max_new_tokens=4, quasar={"cache_implementation": "static"})


def test_static_cache_refuses_bad_options():
    model = tiny_model().eval()
    prompt = repeating_prompt(0)
    with pytest.raises(ValueError, match="cache_implementation must be one of"):
        speculative_generate(model, prompt, max_new_tokens=4, quasar_config={"cache_implementation": "paged"})
    with pytest.raises(TypeError, match="CompileConfig"):
        speculative_generate(model, prompt, max_new_tokens=4, quasar_config={"compile": "max-autotune"})


def test_a_missing_mask_follows_transformers_sdpa_convention():
    """None with 1 < Q < N (Transformers skips the mask for a prefill into an empty static cache):
    row i sees keys 0..i (SDPA's is_causal, top-left); one row sees every key; Q == N is causal."""
    q, k = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 8, 4)
    visible = _visible_keys(None, q, k)
    assert visible.shape == (1, 3, 8) and visible[0].sum(-1).tolist() == [1, 2, 3]
    assert _visible_keys(None, q[:, :, :1], k) is None and _visible_keys(None, q, k[:, :, :3]) is None


@needs_kernels
def test_compiled_steps_measurement_reports_a_checkpoint(tmp_path):
    """`python -m benchmarks compiled-steps` on a saved tiny checkpoint (aot_eager, steps only)."""
    import json

    from benchmarks.speed import compiled_steps

    quasar_model(tmp_path, "llama", torch.bfloat16).save_pretrained(tmp_path / "saved")
    argv = ["--quantized", str(tmp_path / "saved"), "--steps", "1", "--rounds", "1", "--prompts", "0"]
    paths = compiled_steps.main([*argv, "--backend", "aot_eager", "--out", str(tmp_path), "--name", "steps"])
    torch._dynamo.reset()
    report = json.loads(open(paths[0]).read())
    assert {row["tokens"] for row in report["steps"].values()} == {1, 6} and report["environment"]
    assert all(row["static_compiled_ms"] > 0 for row in report["steps"].values())
    assert set(report["guard_check_ms"]) == {"1_tokens", "6_tokens"} and report["guards"].startswith("recursive dict tags")
    linears = report["op_overhead"]["6"]["kinds"]["w8a8_linear"]  # tiny llama: 2 layers x (q/k/v, o, gate/up, down)
    assert linears["calls"] == 8 and linears["op_us"] > 0 and linears["direct_us"] > 0
    if native.is_available():  # what a compiled CPU step calls: the ops C++ serves
        assert linears["native_us"] > 0 and report["op_overhead"]["6"]["native_ops_ms"] > 0
    assert "| static compiled ms |" in open(paths[1]).read()
    with pytest.raises(SystemExit, match="no such file"):  # llama.cpp's steps need a GGUF that exists
        compiled_steps.main([*argv, "--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path), "--name", "x"])


@needs_kernels
def test_compiled_quasar_equals_transformers_compiled_static_generate(tmp_path):
    """Plain compiled decoding as Transformers runs it (`cache_implementation="static"` + `compile_config`,
    which the quantizer allows: is_compileable) gives the tokens of compiled `quasar=True` with that config."""
    model = quasar_model(tmp_path, "qwen3", torch.bfloat16)
    assert model.hf_quantizer.is_compileable
    config = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager")
    config._compile_all_devices = True  # generate compiles CPU steps only when asked to
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        for seed in range(2):
            prompt = repeating_prompt(seed)
            kwargs = {"max_new_tokens": 24, "do_sample": False, "compile_config": config}
            plain = model.generate(prompt, cache_implementation="static", **kwargs, quasar=False)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "generate compiled its decode step"
            assert torch.equal(model.generate(prompt, quasar={"compile": True}, **kwargs), plain), f"seed {seed}"
    torch._dynamo.reset()


def _tag_safe_roots(guard_manager) -> list[str]:
    """Sources of the modules whose guards Dynamo skips while their dicts' version tags are unchanged."""
    roots, stack = [], [guard_manager.root]
    while stack:
        node = stack.pop()
        if node.is_tag_safe_root():
            roots.append(node.get_source())
            continue
        stack.extend(node.get_child_managers())
        if hasattr(node, "get_key_value_managers"):  # a dict's entries (e.g. a module's _modules)
            stack.extend(m for pair in node.get_key_value_managers().values() for m in pair if m is not None)
    return roots


def _module_source(name: str) -> str:
    """How Dynamo's guards name submodule `name` of the compiled model (the step function's `module`)."""
    return "L['module']" + "".join(f"._modules['{part}']" for part in name.split("."))


@needs_kernels
def test_a_compiled_step_checks_quantized_modules_by_dict_tags_and_still_sees_a_change(tmp_path):
    """step_compiler.compiled_step: every W8A8Linear lies under a tag-safe root (its ~5 guards per tensor are
    skipped while its dicts are unchanged), and a module changed after compiling is still seen: a bias
    added to one linear recompiles the step, whose logits then follow the new bias."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from quasar_hf.nn import W8A8Linear
    from quasar_hf.speculative import step_compiler

    model = quasar_model(tmp_path, "llama", torch.float32)
    torch._dynamo.reset()
    callers_setting = torch._dynamo.config.use_recursive_dict_tags_for_guards  # False on 2.13, True on 2.11
    step = step_compiler.compiled_step(model, AOT_EAGER)
    ids = repeating_prompt(0)
    with torch.no_grad():
        before = step(input_ids=ids, use_cache=False).logits
        entries = _debug_get_cache_entry_list(step.__wrapped__.__code__)
        assert len(entries) == 1, "the compiled frame is the step's own function"
        roots = _tag_safe_roots(entries[0].guard_manager)
        linears = [_module_source(name) for name, module in model.named_modules() if isinstance(module, W8A8Linear)]
        assert linears and all(any(source.startswith(root) for root in roots) for source in linears), roots
        linear = model.model.layers[1].self_attn.o_proj
        del linear.bias
        linear.register_buffer("bias", torch.full((linear.out_features,), 0.5))
        linear.prepare()
        after = step(input_ids=ids, use_cache=False).logits
        eager = model(input_ids=ids, use_cache=False).logits
    torch._dynamo.reset()
    assert (after - before).abs().max() > 1e-3
    assert torch._dynamo.config.use_recursive_dict_tags_for_guards == callers_setting  # never changed
    torch.testing.assert_close(after, eager)


@needs_kernels
def test_a_compiled_step_never_changes_the_callers_dynamo_settings(tmp_path):
    """The dict-tag and precompile settings are fixed when the step is made, in a context of the step's own:
    the step's compile sees them; the caller, before, during (another thread) and after, reads Dynamo's
    defaults."""
    import threading

    from quasar_hf import compat
    from quasar_hf.speculative import step_compiler

    if compat.step_context() is None:
        pytest.skip("this torch keeps Dynamo's settings outside context variables: steps compile with its defaults")
    model = quasar_model(tmp_path, "llama", torch.float32)
    torch._dynamo.reset()
    seen_inside, seen_outside = [], []
    compiling, done = threading.Event(), threading.Event()

    def spying_backend(graph_module, example_inputs, **options):
        config = torch._dynamo.config
        seen_inside.append((config.use_recursive_dict_tags_for_guards, config.caching_precompile))
        compiling.set()
        done.wait(timeout=30)  # hold the compile while the other thread looks
        return graph_module.forward

    def other_thread():
        compiling.wait(timeout=30)
        seen_outside.append((torch._dynamo.config.use_recursive_dict_tags_for_guards, torch._dynamo.config.caching_precompile))
        done.set()

    watcher = threading.Thread(target=other_thread)
    watcher.start()
    config = CompileConfig(fullgraph=True, dynamic=False, backend=spying_backend)
    step = step_compiler.compiled_step(model, config, "quasar_step_settings_test", precompile=compat.precompile_supported())
    assert not torch._dynamo.config.use_recursive_dict_tags_for_guards and not torch._dynamo.config.caching_precompile
    with torch.no_grad():
        step(input_ids=repeating_prompt(0), use_cache=False)
    watcher.join()
    torch._dynamo.reset()
    assert seen_inside == [(True, compat.precompile_supported())] and seen_outside == [(False, False)]
    assert not torch._dynamo.config.use_recursive_dict_tags_for_guards and not torch._dynamo.config.caching_precompile


@needs_kernels
def test_rows_that_pad_a_batch_take_no_prefill_and_rows_keep_their_bits(tmp_path):
    """3 prompts in a 4-row static cache (a compiled step's bucket): the prefill runs the 3 real rows only,
    and every step's logits equal those of the same cache prefilled over all 4 rows (a fresh cache does
    that: its first write allocates the rows)."""
    model = quasar_model(tmp_path, "llama", torch.float32)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (1, n), generator=generator) for n in (30, 22, 30)]
    ids, mask = left_padded(prompts)
    slots = static_cache_slots(60)
    steps = [torch.randint(0, 96, (3, w), generator=generator) for w in (1, 4, 1)]
    seen = []
    original = model.forward

    def spy(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape[0])
        return original(*args, **kwargs)

    with torch.no_grad():
        kv = StaticCacheBuffer.fresh(model, slots)
        runs = []
        for _ in range(2):  # first: a fresh cache (all 4 rows prefill); then the same cache reused
            cache = StaticVerifierCache(model, 4, torch.device("cpu"), slots, batch_size=3, kv=kv)
            model.forward = spy
            outs = [cache.forward(ids, mask, last_only=True)] + [cache.forward(t) for t in steps]
            model.forward = original
            runs.append(outs)
    assert seen[0] == 4 and seen[len(steps) + 1] == 3, "the reused cache prefilled the real rows only"
    for fresh, reused in zip(*runs):
        assert fresh.shape[0] == 3 and torch.equal(fresh, reused)
