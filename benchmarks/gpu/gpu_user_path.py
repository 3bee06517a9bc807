"""gpu-check's first section: what a user does first, on the check's device, through the public API.

    quantize   from_pretrained(base, quantization_config=QuasarConfig(), device_map=device): calibrated,
               smoothed and rounded layer by layer on that device (seconds, where it computed)
    reload     save_pretrained, from_pretrained again: the same logits, bit for bit
    generate   generate(quasar=True) against plain greedy decoding of the same model, eager and compiled
               (`quasar={"compile": True}` against `quasar={"compile": True, "num_draft_tokens": 0}`),
               batch 1 and a left-padded batch of 2: equal tokens per row

The model is a random-weight Llama with a real tokenizer (SmolLM2's by default), so the text means
nothing; exactness and the mechanics are what is checked. Every step records its own error with the
full traceback and the next step still runs when it can.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from quasar_hf.detect import plain_decoding

# The model gpu_check quantizes: a Llama of SmolLM2's family, narrower and shallower (random weights).
USER_MODEL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4)
USER_MODEL_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n# Test it\n",
    "The meeting has been postponed until further notice. The meeting has been postponed",
]


def default_tokenizer_dir() -> str:
    """SmolLM2's tokenizer folder from the embedded model (quasar_hf.models), or a clear error."""
    try:
        from quasar_hf.models import smollm2_135m_instruct

        return smollm2_135m_instruct()
    except Exception as err:  # noqa: BLE001 - the embedded model's packages are absent on a GPU image
        raise RuntimeError(
            f"no tokenizer: the embedded SmolLM2 is unavailable here ({err}). Pass --tokenizer DIR (a folder with "
            "tokenizer files; see benchmarks/gpu/gpu_check.sh for carrying one to a GPU machine)"
        ) from None


def save_random_base(folder: str, tokenizer_dir: str, tiny: bool) -> Any:
    """A random-weight bf16 Llama over the tokenizer's vocabulary, saved with the tokenizer; returns the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        **(USER_MODEL_TINY if tiny else USER_MODEL),
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def _step(out: dict, name: str, fn: Callable[[], Any]) -> Any:
    """Run one step into out[name] (its result, or its full traceback under out["errors"][name])."""
    start = time.monotonic()
    try:
        out[name] = fn()
        return out[name]
    except Exception:  # noqa: BLE001 - the check records every failure and goes on
        out.setdefault("errors", {})[name] = traceback.format_exc()
        return None
    finally:
        out.setdefault("step_s", {})[name] = round(time.monotonic() - start, 2)


def _batches(tokenizer, device: str) -> dict[str, dict]:
    """batch 1 and a left-padded batch of 2 (prompts of different lengths)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    one = tokenizer(PROMPTS[:1], return_tensors="pt")
    two = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (two.attention_mask == 0).any(), "the batch of 2 must hold padding"
    return {name: {k: v.to(device) for k, v in enc.items()} for name, enc in (("batch1", one), ("batch2_left_padded", two))}


def compare_generation(model, tokenizer, device: str, tiny: bool) -> dict:
    """Plain greedy vs quasar=True, eager and compiled, per batch: equal tokens per row, and seconds."""
    max_new = 16 if tiny else 64
    modes = {
        "eager": (plain_decoding(model), {"quasar": True}),
        "compiled": ({"quasar": {"compile": True, "num_draft_tokens": 0}}, {"quasar": {"compile": True}}),
    }
    results = {}
    for mode, (plain_kwargs, quasar_kwargs) in modes.items():
        for batch_name, batch in _batches(tokenizer, device).items():
            row = {}
            outputs = {}
            for name, extra in (("plain", plain_kwargs), ("quasar", quasar_kwargs)):
                start = time.perf_counter()
                outputs[name] = model.generate(**batch, max_new_tokens=max_new, do_sample=False, **extra)
                row[f"{name}_s"] = round(time.perf_counter() - start, 3)
            plain, quasar = outputs["plain"], outputs["quasar"]
            row["equal_rows"] = [bool(torch.equal(p, q)) for p, q in zip(plain, quasar)] if plain.shape == quasar.shape else []
            row["equal"] = bool(row["equal_rows"]) and all(row["equal_rows"])
            row["new_tokens"] = int(plain.shape[1] - batch["input_ids"].shape[1])
            results[f"{mode}_{batch_name}"] = row
    return results


def user_path(device: str, tiny: bool, tokenizer_dir: str | None = None, work_dir: str | None = None) -> dict:
    """The section: quantize on `device` through from_pretrained, save, reload, generate (see the module doc)."""
    from transformers import AutoModelForCausalLM

    from quasar_hf import QuasarConfig

    out: dict = {"device": device}
    with tempfile.TemporaryDirectory(dir=work_dir) as root:
        base, saved = os.path.join(root, "base"), os.path.join(root, "quasar")
        tokenizer = _step(out, "base_model", lambda: save_random_base(base, tokenizer_dir or default_tokenizer_dir(), tiny))
        if tokenizer is None:
            return out
        out["base_model"] = {"config": USER_MODEL_TINY if tiny else USER_MODEL, "vocab": len(tokenizer)}
        config = QuasarConfig(num_calibration_samples=4, calibration_seq_len=64) if tiny else QuasarConfig()
        holder: dict = {}  # the models the steps hand on (kept out of the JSON result)

        def quantize():
            start = time.perf_counter()
            model = AutoModelForCausalLM.from_pretrained(
                base, quantization_config=config, dtype=torch.bfloat16, device_map=device
            )
            seconds = time.perf_counter() - start
            info = model.config.quantization_config
            info = info.calibration_info if hasattr(info, "calibration_info") else info["calibration_info"]
            holder["model"] = model.eval()
            return {"seconds": round(seconds, 2), "calibrated_on": info.get("device"), "math_dtype": info.get("math_dtype")}

        if _step(out, "quantize", quantize) is None:
            return out
        model = holder.pop("model")
        probe = tokenizer(PROMPTS[0], return_tensors="pt").input_ids.to(device)

        def reload():
            model.save_pretrained(saved)
            tokenizer.save_pretrained(saved)
            again = AutoModelForCausalLM.from_pretrained(saved, device_map=device).eval()
            with torch.no_grad():
                same = bool(torch.equal(model(probe).logits, again(probe).logits))
            holder["reloaded"] = again
            return {"identical_logits": same, "dtype": str(next(again.parameters()).dtype)}

        _step(out, "save_reload", reload)
        model = holder.pop("reloaded", model)
        _step(out, "generate", lambda: compare_generation(model, tokenizer, device, tiny))
    out["ok"] = not out.get("errors") and bool(out.get("save_reload", {}).get("identical_logits"))
    out["ok"] = out["ok"] and all(row["equal"] for row in (out.get("generate") or {}).values())
    return out
