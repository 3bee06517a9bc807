"""What a Quasar model does beyond its class: bound on the model instance by the quantizer.

`bind_quasar_methods(model)` (called when a model is quantized on load and when a saved Quasar
checkpoint is reloaded) sets these instance attributes; Transformers' classes are never changed,
so every other model in the process behaves exactly as without quasar_hf.
  * generate: Quasar speculative decoding (`quasar_hf.speculative.strategy.generate_with_quasar`) by
    default, as the generation config's `quasar` field says (speculative/defaults.py); `quasar=True |
    dict | QuasarGenerationConfig` asks for it explicitly (unsupported options then raise),
    `assistant_model=` alone means W8A8 verification of the assistant's drafts, and `quasar=False` is
    the class's generate.
  * save_pretrained: the class's save, then the model card (README.md, or QUASAR_MODEL_CARD.md
    beside a README quasar_hf did not write, with a warning), written into a staging folder and
    swapped in whole (`quasar_hf.atomic_folder`).
  * push_to_hub: the class's signature (repo_id positional, the options as keywords, plus
    `tokenizer=` and `base_model=`), uploaded with the card kept (`hub.push_quasar_model`).
  * _apply (behind `.to()`, `.cuda()`, `.bfloat16()`, ...), half, float: a dtype change is all or
    nothing. The compute dtypes the kernels take (float32, bfloat16, float16) convert the whole model,
    with int8 weights and fp32 scales kept (PreparedModule.fp32_buffers); any other dtype is refused
    before a tensor changes.
  * init_continuous_batching: Transformers' continuous-batching entry point (`transformers serve
    --continuous-batching`), answered by a RequestBatcher of batched Quasar calls
    (speculative/continuous_batching.py) instead of paged attention, which a Quasar model does not run.
  * train: refused (`train(False)`, what `eval()` calls, is the class's). A forward hook makes a backward
    pass through the outputs raise instead of computing gradients that skip every int8 linear.
  * a load_state_dict pre-hook: a tensor that is not int8 given for an int8 weight is refused, naming its
    key, before anything is copied (torch would truncate a float tensor into it).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Any

import torch

from quasar_hf.atomic_folder import atomic_folder
from quasar_hf.detect import is_quasar_model
from quasar_hf.speculative.continuous_batching import init_continuous_batching

NOT_QUANTIZED_HELP = (
    "quasar=... needs a Quasar W8A8 model. Quantize it first: "
    "`import quasar_hf; from quasar_hf import QuasarConfig; model = AutoModelForCausalLM.from_pretrained(path, "
    "quantization_config=QuasarConfig(), dtype=torch.bfloat16)`. To run the same speculative loop with this "
    "(unquantized) model as verifier: model.generate(ids, custom_generate=quasar_hf.generate, quasar=True), "
    "or quasar_hf.speculative_generate(model, ids, ...)."
)


class ModelMethod(functools.partial):
    """A function bound to one model instance, as a method is, that also pickles with the model
    (a bound method of a module-level function does not: pickle looks it up by name on the class)."""

    @property
    def __self__(self) -> Any:
        return self.args[0]

    @property
    def __func__(self) -> Any:
        return self.func

    @property
    def __name__(self) -> str:
        return self.func.__name__


def bind_quasar_methods(model: Any) -> None:
    """Give this model instance Quasar's generate, save_pretrained and push_to_hub, the refusal of training,
    and the load check of int8 weights (idempotent)."""
    model.generate = ModelMethod(quasar_generate, model)
    model.save_pretrained = ModelMethod(save_pretrained_with_card, model)
    model.push_to_hub = ModelMethod(push_to_hub_with_card, model)
    model._apply = ModelMethod(apply_all_or_nothing, model)
    model.half = ModelMethod(to_dtype, model, torch.float16)
    model.float = ModelMethod(to_dtype, model, torch.float32)
    model.train = ModelMethod(train_refused, model)
    model.init_continuous_batching = ModelMethod(init_continuous_batching, model)
    if not getattr(model, HOOKS_MARK, False):  # torch hooks (an extension point of every module), once per model
        model.register_forward_hook(refuse_backward_through_outputs)
        model.register_load_state_dict_pre_hook(refuse_non_int8_weights)
        setattr(model, HOOKS_MARK, True)


HOOKS_MARK = "quasar_inference_hooks"
TRAINING_HELP = (
    "a Quasar W8A8 model is for inference only: its int8 linears have no gradient, so a backward pass would reach "
    "only the embeddings and norms (through the residual stream) and an optimizer step would silently make the "
    "model worse. Fine-tune the float model, then quantize it with QuasarConfig; run this one under model.eval() "
    "and torch.no_grad() (generate does)."
)


def train_refused(self: Any, mode: bool = True) -> Any:
    """`model.train()` refused with the reason; `model.train(False)` (what `model.eval()` calls) as the class's."""
    if mode:
        raise ValueError(f"model.train(): {TRAINING_HELP}")
    return type(self).train(self, False)


class RefusedBackward(torch.autograd.Function):
    """Identity forward; a backward through it raises TRAINING_HELP (a raw `loss.backward()` never runs silently)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"backward through a Quasar model: {TRAINING_HELP}")


def refuse_backward_through_outputs(module: Any, args: Any, output: Any) -> Any:
    """Forward hook: with autograd recording, every output tensor that requires grad (loss, logits, hidden
    states) passes through RefusedBackward. Under torch.no_grad() (generate, inference) it does nothing."""
    if not torch.is_grad_enabled():
        return None
    if isinstance(output, torch.Tensor):
        return RefusedBackward.apply(output) if output.requires_grad else output
    if isinstance(output, dict):  # a ModelOutput: item assignment updates the attribute too
        for key, value in list(output.items()):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                output[key] = RefusedBackward.apply(value)
        return output
    if isinstance(output, tuple):
        return tuple(RefusedBackward.apply(v) if isinstance(v, torch.Tensor) and v.requires_grad else v for v in output)
    return None


def refuse_non_int8_weights(model: Any, state_dict: dict, prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook of the whole model: every int8 W8A8 weight given is checked before any tensor
    is copied, so a refused load leaves the model as it was."""
    from quasar_hf.hf.fusion import w8a8_weight_shapes
    from quasar_hf.nn.w8a8_linear import check_int8_weight

    for key, shape in w8a8_weight_shapes(model).items():
        if prefix + key in state_dict:
            check_int8_weight(prefix + key, state_dict[prefix + key], shape)


COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the W8A8 and attention kernels take


def apply_all_or_nothing(self: Any, fn: Any, recurse: bool = True) -> Any:
    """The class's `_apply`, after checking on a probe tensor that `fn` keeps floats in a compute dtype."""
    param = next(self.parameters(), None)
    probe = torch.zeros(4, 1, 1, 1, device=param.device if param is not None else "cpu")
    try:
        target = fn(probe).dtype
    except (RuntimeError, TypeError, ValueError):  # fn does not apply to the probe: the class decides
        target = probe.dtype
    if target not in COMPUTE_DTYPES:
        raise ValueError(
            f"a Quasar model computes in float32, bfloat16 or float16, not {target}; nothing was converted. "
            f"Use model.to(torch.bfloat16) (or float16/float32): int8 weights and their fp32 scales stay as they are."
        )
    return type(self)._apply(self, fn, recurse)


def to_dtype(self: Any, dtype: torch.dtype, *args: Any) -> Any:
    """`.half()` / `.float()`: the whole model in that compute dtype, as `.to(dtype)` (apply_all_or_nothing)."""
    return self.to(dtype)


def quasar_generate(self: Any, *args: Any, quasar: Any = None, **kwargs: Any) -> Any:
    """`generate` of a Quasar model: Quasar decoding by default (the generation config's `quasar` field,
    speculative/defaults.py), plain decoding with `quasar=False` or where a default meets a call the
    speculative loop does not run (speculative/call_rules.py, the reason logged once); `quasar=...` or
    `assistant_model=` ask for Quasar explicitly."""
    from quasar_hf.speculative.call_rules import check_call, generate_arguments
    from quasar_hf.speculative.defaults import default_quasar, log_declined
    from quasar_hf.speculative.strategy import generate_with_quasar

    if quasar is False:
        return type(self).generate(self, *args, **kwargs)
    if quasar is None and generate_arguments(args, kwargs).get("assistant_model") is not None:
        quasar = True  # an assistant's drafts, verified by the W8A8 model: explicit
    elif quasar is None:
        quasar = default_quasar(self, args, kwargs) if is_quasar_model(self) else False
        reason = None if quasar is False else check_call(self, args, kwargs)
        if reason is not None:
            log_declined(reason)
        if quasar is False or reason is not None:
            return type(self).generate(self, *args, **kwargs)
    if not is_quasar_model(self):
        raise ValueError(NOT_QUANTIZED_HELP)
    return generate_with_quasar(self, *args, quasar=quasar, **kwargs)


def save_pretrained_with_card(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """The class's save_pretrained and the model card, swapped into `save_directory` in one step
    (`quasar_hf.atomic_folder`): a save that fails or is killed leaves the previous checkpoint as it was."""
    original = type(self).save_pretrained
    arguments = inspect.signature(original).bind(self, save_directory, *args, **kwargs).arguments
    if not is_quasar_model(self) or not arguments.get("is_main_process", True):
        return original(self, save_directory, *args, **kwargs)
    _check_saved_default(self)
    options = {name: value for name, value in arguments.items() if name not in ("self", "save_directory", "kwargs")}
    options.update(arguments.get("kwargs", {}))
    if options.get("safe_serialization", True) is False:
        raise ValueError(
            "save_pretrained(safe_serialization=False): Quasar checkpoints are safetensors only (each file's header "
            "carries the layout record and every tensor's SHA-256 that a load checks); drop safe_serialization=False."
        )
    hub = {}
    if options.pop("push_to_hub", False):  # uploaded after the save by push_to_hub: marked, with the card
        hub_names = inspect.signature(type(self).push_to_hub).parameters
        hub = {name: options.pop(name) for name in list(options) if name in hub_names and name != "max_shard_size"}
        hub.setdefault("repo_id", os.path.basename(os.path.normpath(os.fspath(save_directory))))
    with atomic_folder(save_directory) as staging:
        result = save_quasar_files(self, staging, **options)
    if hub:
        push_to_hub_with_card(self, hub.pop("repo_id"), max_shard_size=options.get("max_shard_size", "50GB"), **hub)
    return result


def _check_saved_default(model: Any) -> None:
    """A `quasar` setting in the generation config that generate cannot run is not written into a checkpoint:
    ValueError naming the field and the fix (speculative/defaults.py)."""
    from quasar_hf.speculative.defaults import FIELD, checked_setting, model_field

    value = getattr(getattr(model, "generation_config", None), FIELD, None)
    if value is not None:
        checked_setting(value, model_field(model))


def save_quasar_files(model: Any, folder: Any, *args: Any, **kwargs: Any) -> Any:
    """The class's save_pretrained into `folder` as it is (no staging), the mark that makes Transformers
    without quasar_hf refuse it (hf/checkpoint_config.py), then the model card."""
    from quasar_hf.hf.checkpoint_config import mark_checkpoint, why_unmarkable

    result = type(model).save_pretrained(model, folder, *args, **kwargs)
    reason = why_unmarkable(model.config.to_dict())
    if reason is None:
        mark_checkpoint(folder)
    else:
        warnings.warn(
            f"saved without the mark that makes Transformers refuse this checkpoint when quasar_hf is missing: {reason}",
            UserWarning,
            stacklevel=3,
        )
    save_card(model, folder)
    return result


def push_to_hub_with_card(self: Any, *args: Any, tokenizer: Any = None, base_model: str | None = None, **kwargs: Any) -> Any:
    """Transformers' push_to_hub arguments (checked against its signature), uploaded with the Quasar card."""
    original = type(self).push_to_hub
    if not is_quasar_model(self):
        return original(self, *args, **kwargs)
    arguments = inspect.signature(original).bind(self, *args, **kwargs).arguments
    arguments.pop("self")
    arguments.update(arguments.pop("kwargs", {}))
    from quasar_hf.hub.push import push_quasar_model

    return push_quasar_model(self, tokenizer=tokenizer, base_model=base_model, **arguments)


def save_card(model: Any, save_directory: Any) -> None:
    """Render and write the card; a card failure warns instead of failing an otherwise good save."""
    from quasar_hf.hub.model_card import model_card_for, write_model_card

    try:
        write_model_card(save_directory, model_card_for(model))
    except (ValueError, TypeError, OSError) as error:
        warnings.warn(f"quasar_hf could not write the model card to {save_directory}: {error}", UserWarning, stacklevel=3)
