"""Every private name of another package that quasar_hf relies on, one module per vendor and concern.

Private API (underscore names, internal registries, cache layer classes, Dynamo's settings,
Accelerate's hooks) moves between releases. The rest of the package calls the small functions here
(`from quasar_hf import compat; compat.cache_key_values(cache)`), so an upgrade changes this package
only; `tests/test_layering.py` fails when another module reaches such a name. Supported: Transformers
5.17 - 5.24.

  transformers_generation.py  attention implementation and registries, pad token, a call's merged generation
                              config, the KV cache's argument and output names, GenerationConfig fields, where
                              a model came from
  transformers_cache.py       dynamic and static KV cache layers: their keys and values, write position, rows
  transformers_serving.py     `transformers serve`'s stream error and Rust tokenizer, the config-type log filter
  transformers_serving_app.py the `transformers serve` app's classes serving/ builds on (not re-exported here:
                              they load FastAPI; `from quasar_hf.compat.transformers_serving_app import ...`)
  torch_dynamo.py             the CompileConfig of compiled steps, Dynamo's settings in a context of their own,
                              its counters, recompile-limit error, disk cache folder and generated-name counter
  torch_modules.py            shallow module copies (torch.nn.Module's child table)
  accelerate_hooks.py         Accelerate's dispatch and offload hooks, offloaded tensors read from them
"""

from .accelerate_hooks import (
    accelerate_holds_weights,
    accelerate_skip_keys,
    detach_accelerate_hook,
    dispatch_resident,
    has_accelerate_hook,
    input_device,
    move_accelerate_hook,
    state_dict_values,
)
from .torch_dynamo import (
    default_compile_config,
    dynamo_cache_hits,
    graphs_built,
    precompile_supported,
    precompiled_folder,
    recompile_limit_error,
    skip_dynamo_names_taken,
    step_context,
)
from .torch_modules import shallow_module_copy
from .transformers_cache import (
    append_kv_in_place,
    cache_key_values,
    clear_static_cache,
    copy_static_cache_rows,
    fill_static_cache,
    full_attention_static_cache,
    is_full_attention_layer,
    replace_cache_key_values,
    set_static_cache_length,
    static_cache_filled,
    static_cache_first_rows,
    static_cache_tensors,
)
from .transformers_generation import (
    attn_implementation,
    cache_argument_name,
    merged_generation_config,
    name_or_path,
    output_cache,
    pad_token_id,
    register_attention_function,
    set_generation_field,
)
from .transformers_serving import quiet_config_type_warning, rust_tokenizer, serving_stream_error

__all__ = [
    "accelerate_holds_weights",
    "accelerate_skip_keys",
    "append_kv_in_place",
    "attn_implementation",
    "cache_argument_name",
    "cache_key_values",
    "clear_static_cache",
    "copy_static_cache_rows",
    "fill_static_cache",
    "default_compile_config",
    "dynamo_cache_hits",
    "detach_accelerate_hook",
    "dispatch_resident",
    "full_attention_static_cache",
    "graphs_built",
    "has_accelerate_hook",
    "input_device",
    "is_full_attention_layer",
    "merged_generation_config",
    "move_accelerate_hook",
    "name_or_path",
    "output_cache",
    "pad_token_id",
    "precompile_supported",
    "precompiled_folder",
    "quiet_config_type_warning",
    "recompile_limit_error",
    "register_attention_function",
    "replace_cache_key_values",
    "rust_tokenizer",
    "serving_stream_error",
    "set_generation_field",
    "set_static_cache_length",
    "shallow_module_copy",
    "skip_dynamo_names_taken",
    "state_dict_values",
    "static_cache_filled",
    "static_cache_first_rows",
    "static_cache_tensors",
    "step_context",
]
