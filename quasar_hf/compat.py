"""Every private Transformers name quasar_hf relies on, in one module.

Transformers' private API (underscore names, internal registries, cache layer classes) moves
between 5.x releases. The rest of the package calls the small functions here instead, so an
upgrade changes this file only; `tests/test_layering.py` fails when another module reaches a
private Transformers name. Supported: Transformers 5.17 - 5.24.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


# ---------------------------------------------------------------- attention implementations
def attn_implementation(model_or_config: Any) -> str | None:
    """The attention implementation a model (or its config) runs: "sdpa", "eager", a registered name."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "_attn_implementation", None)


def register_attention_function(name: str, function: Callable, mask_function: Callable | None = None) -> None:
    """Register an attention function (and the mask builder it reads) under `name`, once per process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, function)
    if name not in AttentionMaskInterface._global_mapping:
        AttentionMaskInterface.register(name, mask_function or sdpa_mask)


# ---------------------------------------------------------------- generation
def pad_token_id(generation_config: Any) -> int | None:
    """The pad token `generate` settled on for this call (pad_token_id, or eos when none was set)."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is None:
        pad = generation_config.pad_token_id
    if isinstance(pad, torch.Tensor):
        pad = pad.reshape(-1)[0]
    return None if pad is None else int(pad)


def cache_argument_name(model: nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` (5.24) or `past_key_values` (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(outputs: Any) -> Any:
    """The KV cache a forward returned (its field is named like the argument)."""
    return outputs["cache"] if "cache" in outputs else outputs["past_key_values"]


def cache_key_values(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values [B, H, S, D] of a filled dynamic KV cache (the tensors it holds, not copies)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def replace_cache_key_values(cache: Any, key_values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Make each layer of a dynamic KV cache hold these keys and values [B, H, S, D] (rows added or removed)."""
    for layer, (keys, values) in zip(cache.layers, key_values):
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values


def is_full_attention_layer(cache_layer: Any) -> bool:
    """True for a plain full-attention dynamic KV layer (a sliding window counts slots, not tokens)."""
    from transformers.cache_utils import DynamicLayer

    return type(cache_layer) in (DynamicLayer, _append_in_place_layer_class())


def append_kv_in_place(cache: Any) -> bool:
    """Make a fresh cache's full-attention layers append by writing into storage with spare room
    instead of concatenating (`_append_in_place_layer_class`). False (cache untouched) when it
    holds any other or already filled layer."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or layer.is_initialized for layer in layers):
        return False
    layer_class = _append_in_place_layer_class()
    layers[:] = [layer_class() for _ in layers]
    return True


@functools.lru_cache(maxsize=1)
def _append_in_place_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class AppendInPlaceLayer(DynamicLayer):
        """DynamicLayer whose update copies the new K/V into storage [B, H, capacity, D] and keeps
        `keys`/`values` as views [B, H, :length, D] of it: the same values as concatenation, without
        re-copying the whole cache every step. The first fill returns the states themselves (what a
        concatenation onto nothing equals); later calls return the strided views."""

        spare_slots = 256  # room added when the storage grows: at least this, or a quarter more

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            self._storage = self._views = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            old = self.get_seq_length()
            new = old + key_states.shape[-2]
            if not self._fits(new, key_states):
                self._grow(old, new, key_states)
            keys, values = self._storage
            keys[:, :, old:new].copy_(key_states)
            values[:, :, old:new].copy_(value_states)
            self.keys, self.values = keys[:, :, :new], values[:, :, :new]
            self._views = (self.keys, self.values)
            return (key_states, value_states) if old == 0 else (self.keys, self.values)

        def _fits(self, new: int, key_states: torch.Tensor) -> bool:
            """The storage holds these keys (nobody replaced them) and has room for `new` slots."""
            if self._storage is None or self._views is None or self._views[0] is not self.keys:
                return False
            if self._views[1] is not self.values:
                return False
            stored = self._storage[0]
            return (
                stored.shape[2] >= new
                and stored.shape[:2] == key_states.shape[:2]
                and stored.shape[3] == key_states.shape[3]
                and stored.dtype == key_states.dtype
                and stored.device == key_states.device
            )

        def _grow(self, old: int, new: int, key_states: torch.Tensor) -> None:
            batch, heads, _, dim = key_states.shape
            capacity = new + max(self.spare_slots, new // 4)
            keys = key_states.new_empty(batch, heads, capacity, dim)
            values = key_states.new_empty(batch, heads, capacity, dim)
            if old:
                keys[:, :, :old].copy_(self.keys)
                values[:, :, :old].copy_(self.values)
            self._storage = (keys, values)

        def crop(self, tokens_to_remove: int) -> None:
            super().crop(tokens_to_remove)  # slices keys/values: still views of the storage
            self._views = (self.keys, self.values)

        def reset(self) -> None:
            super().reset()
            self._storage = self._views = None

    return AppendInPlaceLayer


def full_attention_static_cache(model: nn.Module, max_cache_len: int) -> tuple[Any, bool]:
    """A StaticCache of `max_cache_len` slots for `model`, every layer a full-attention StaticLayer,
    and whether the model has sliding layers: a sliding layer writes modulo its window, after which
    rejected drafts could not be rolled back; the model's sliding mask still limits each query to
    its window (it counts slots, so it is exact only while a row's kept slots have no holes)."""
    from transformers import StaticCache, StaticLayer

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    sliding = any(layer.is_sliding for layer in cache.layers)
    if sliding:
        cache.layers[:] = [StaticLayer(max_cache_len=max_cache_len) for _ in cache.layers]
    return cache, sliding


def set_static_cache_length(cache: Any, length: int) -> None:
    """Make the next update of every StaticLayer write at slot `length` (5.x layers write at their
    `cumulative_length` counter, a tensor updated in place so that compiled steps keep its address)."""
    for layer in cache.layers:
        layer.cumulative_length.fill_(length)


def set_generation_field(config: Any, name: str, value: Any) -> None:
    """Set a field of a GenerationConfig that its save keeps: a config derived from the model config
    (`_from_model_config`) drops fields Transformers does not know when it is read back, so it is
    marked as a generation config of its own."""
    setattr(config, name, value)
    config._from_model_config = False


def static_cache_filled(cache: Any) -> bool:
    """Whether every layer of a StaticCache has allocated its tensors (they are allocated at the first write)."""
    return all(getattr(layer, "is_initialized", False) for layer in cache.layers)


@contextlib.contextmanager
def static_cache_first_rows(cache: Any, rows: int) -> Iterator[None]:
    """Within the block the StaticCache's filled layers hold only their first `rows` rows: views of the same
    storage (the batch is the outermost dimension), so a forward of `rows` rows writes those rows in place."""
    layers = [layer for layer in cache.layers if getattr(layer, "is_initialized", False)]
    kept = [(layer.keys, layer.values) for layer in layers]
    for layer, (keys, values) in zip(layers, kept):
        layer.keys, layer.values = keys[:rows], values[:rows]
    try:
        yield
    finally:
        for layer, (keys, values) in zip(layers, kept):
            layer.keys, layer.values = keys, values


def copy_static_cache_rows(source: Any, target: Any, target_rows: int, rows: torch.Tensor, length: int) -> None:
    """Slots [0, length) of source's rows `rows` into the first len(rows) of target's `target_rows` rows, every
    layer (a target layer not allocated yet is allocated first), and target's write position to `length`."""
    for old, new in zip(source.layers, target.layers):
        if not getattr(old, "is_initialized", False):
            continue
        if not getattr(new, "is_initialized", False):
            shape = (target_rows, -1, -1, -1)
            new.lazy_initialization(old.keys[:1].expand(*shape), old.values[:1].expand(*shape))
        new.keys[: len(rows), :, :length] = old.keys[rows, :, :length]
        new.values[: len(rows), :, :length] = old.values[rows, :, :length]
    set_static_cache_length(target, length)


def clear_static_cache(cache: Any, written: int) -> None:
    """Zero the first `written` slots of every filled layer of a StaticCache and move its write position to 0:
    the cache a fresh one is, without a new allocation (its tensors keep their addresses)."""
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and written:
            layer.keys[:, :, :written].zero_()
            layer.values[:, :, :written].zero_()
    set_static_cache_length(cache, 0)


def default_compile_config(device: torch.device) -> Any:
    """The CompileConfig of a compiled step: one full graph per static shape; CUDA graphs on CUDA
    (mode "reduce-overhead"'s option), Inductor's C++ code elsewhere (the CPU opt-in that generate checks).
    `emulate_precision_casts` keeps the bf16 rounding after each op that eager has: without it Inductor
    keeps fused intermediates in fp32, and SmolLM2's compiled verify rows then differ from its compiled
    decode steps (benchmarks/reports/compiled-rows/compiled_rows_smollm2_cpu.md). `size_asserts` off drops the size and
    stride check Inductor runs on every graph input and op output at every call (~1,300 per SmolLM2
    step): Dynamo's guards already check the inputs, and our ops' fake implementations are tested
    against the real ones (opcheck in tests/test_ops_torch_ops.py). What `quasar={"compile": True}`
    compiles with: no graph pass, the modules already call the fused ops."""
    from transformers import CompileConfig

    cuda = torch.device(device).type == "cuda"
    options = {"emulate_precision_casts": True, "size_asserts": False}
    if cuda:
        options["triton.cudagraphs"] = True  # what mode="reduce-overhead" sets (torch takes a mode or options)
    config = CompileConfig(fullgraph=True, dynamic=False, mode=None, options=options)
    config._compile_all_devices = not cuda  # generate compiles CPU steps only when asked to
    return config


def step_context(precompile: bool = False) -> contextvars.Context | None:
    """A copy of the current context in which Dynamo builds guards on recursive dict tags (and, with
    `precompile` where this torch has it, caches traced code on disk), or None where Dynamo does not
    keep those settings in context variables (a value set inside a copy would leak)."""
    entries = getattr(torch._dynamo.config, "_config", {})
    names = ["use_recursive_dict_tags_for_guards"] + (["caching_precompile"] if precompile_supported() and precompile else [])
    if not all(isinstance(getattr(entries.get(n), "user_override", None), contextvars.ContextVar) for n in names):
        return None
    context = contextvars.copy_context()
    context.run(_enable_step_settings, "caching_precompile" in names)
    return context


def _enable_step_settings(precompile: bool) -> None:
    """Run inside `step_context`'s private copy only."""
    torch._dynamo.config.use_recursive_dict_tags_for_guards = True
    if precompile:
        torch._dynamo.config.caching_precompile = True


def precompile_supported() -> bool:
    """Whether this torch can keep Dynamo's traced code on disk (torch._dynamo.config.caching_precompile)."""
    entry = getattr(torch._dynamo.config, "_config", {}).get("caching_precompile")
    return isinstance(getattr(entry, "user_override", None), contextvars.ContextVar)


# ---------------------------------------------------------------- serving (transformers.cli.serving)
def serving_stream_error(message: str) -> Any:
    """The item Transformers' serving handlers read from a stream queue as "this request failed: message"."""
    from transformers.cli.serving.utils import _StreamError

    return _StreamError(message)


def rust_tokenizer(processor: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a fast tokenizer or a processor (what DirectStreamer decodes with)."""
    return getattr(processor, "tokenizer", processor)._tokenizer


# ---------------------------------------------------------------- configs
class _MarkedConfigRead(logging.Filter):
    """Drops Transformers' "You are using a model of type `quasar_hf` to instantiate a model of type ..." record."""

    def __init__(self, model_type: str) -> None:
        super().__init__()
        self.prefix = f"You are using a model of type `{model_type}` to instantiate"

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefix)


def quiet_config_type_warning(model_type: str) -> None:
    """A model class named directly (`LlamaForCausalLM.from_pretrained`, as `transformers serve` loads) reads a
    config.json of `model_type` with its own config class, and Transformers warns that the types differ. For
    a Quasar checkpoint read with quasar_hf imported, that read is right, so only this message about only this
    type is dropped from the logger Transformers emits it on (idempotent)."""
    logger = logging.getLogger("transformers.configuration_utils")
    if not any(
        isinstance(f, _MarkedConfigRead) and f.prefix.startswith(f"You are using a model of type `{model_type}`")
        for f in logger.filters
    ):
        logger.addFilter(_MarkedConfigRead(model_type))


def name_or_path(model_or_config: Any) -> str:
    """Where a model was loaded from (Hub id or local folder), "" when unknown."""
    name = getattr(model_or_config, "name_or_path", None)
    if not name:
        config = getattr(model_or_config, "config", model_or_config)
        name = getattr(config, "_name_or_path", None)
    return str(name or "")


# ---------------------------------------------------------------- module surgery
def shallow_module_copy(module: nn.Module, replace: dict[str, nn.Module] | None = None) -> nn.Module:
    """A copy of `module` sharing every parameter and child, with its own child table (`replace` swaps children).

    Attribute changes on the copy (e.g. a decoder layer's attention `layer_idx`) leave the original alone.
    """
    new = copy.copy(module)
    new._modules = dict(module._modules)
    for name, child in (replace or {}).items():
        new._modules[name] = child
    return new


def has_accelerate_hook(module: nn.Module) -> bool:
    """True when accelerate dispatches this module (device_map offload hooks move its weights itself)."""
    return hasattr(module, "_hf_hook")


def _align_hooks(module: nn.Module) -> list[Any]:
    """The AlignDevicesHooks accelerate attached to `module` itself (inside a SequentialHook too)."""
    hook = getattr(module, "_hf_hook", None)
    hooks = list(getattr(hook, "hooks", [hook])) if hook is not None else []
    return [h for h in hooks if hasattr(h, "execution_device")]


def _offloading_hooks(module: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(submodule, hook) for every accelerate hook under `module` that holds offloaded weights."""
    return [
        (sub, hook)
        for sub in module.modules()
        for hook in _align_hooks(sub)
        if getattr(hook, "offload", False) and getattr(hook, "weights_map", None) is not None
    ]


def input_device(model: nn.Module) -> torch.device:
    """Where to put a model's input ids: the device of its first resident parameter (an offloaded one is on
    the meta device; accelerate's hooks move inputs on to each module's execution device)."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def state_dict_values(model: nn.Module, state_dict: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of `state_dict` (default: the model's), an offloaded one (on the meta
    device, its value held by an accelerate hook in memory or on disk) read from its hook, one at a time:
    what a save writes for it (Transformers' `load_offloaded_parameter`)."""
    from transformers.integrations.accelerate import load_offloaded_parameter

    for name, tensor in (model.state_dict() if state_dict is None else state_dict).items():
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
            try:
                tensor = load_offloaded_parameter(model, name)
            except (ValueError, KeyError, AttributeError):
                raise ValueError(
                    f"{name} is on the meta device and no accelerate hook holds its value; load the model with its "
                    "weights (device_map placement and offload are fine, a meta-device skeleton is not)"
                ) from None
        yield name, tensor


def accelerate_holds_weights(module: nn.Module) -> bool:
    """True when accelerate hooks under `module` hold the values of its offloaded (meta) weights."""
    return bool(_offloading_hooks(module))


def detach_accelerate_hook(module: nn.Module, device: torch.device) -> None:
    """Remove the accelerate hooks under `module`, first giving every weight they held offloaded (on the
    meta device) its value on `device`: the module then runs like any resident module."""
    from accelerate.hooks import remove_hook_from_module
    from accelerate.utils import named_module_tensors, set_module_tensor_to_device

    for sub, hook in _offloading_hooks(module):
        tensors = named_module_tensors(sub, include_buffers=hook.offload_buffers, recurse=hook.place_submodules)
        for name, tensor in list(tensors):
            if tensor.device.type == "meta":
                set_module_tensor_to_device(sub, name, device, value=hook.weights_map[name])
    remove_hook_from_module(module, recurse=True)


def dispatch_resident(module: nn.Module, device: torch.device, skip_keys: Any = None) -> None:
    """Attach an accelerate hook that runs `module`, resident on `device`, there: its inputs are moved to
    `device` (except `skip_keys`, e.g. the KV cache), as a device_map's dispatch does for resident layers."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    add_hook_to_module(module, AlignDevicesHook(execution_device=device, io_same_device=False, skip_keys=skip_keys))


def accelerate_skip_keys(module: nn.Module) -> Any:
    """The inputs accelerate's hooks on `module` leave where they are (None without hooks)."""
    hooks = _align_hooks(module)
    return hooks[0].skip_keys if hooks else None


def move_accelerate_hook(old: nn.Module, new: nn.Module) -> bool:
    """Attach `old`'s accelerate hook to `new`, a replacement holding the same resident Parameters.
    False (nothing done) when `old` has no hook or its weights are offloaded (on the meta device)."""
    if not has_accelerate_hook(old) or any(p.device.type == "meta" for p in old.parameters()):
        return False
    from accelerate.hooks import add_hook_to_module

    add_hook_to_module(new, old._hf_hook)
    return True
