"""What a compressed-tensors export says about who reads it right: a config.json block and a model card.

Transformers' compressed-tensors loader does not apply `quantization_config.transform_config`
(transformers#40673, which would have, was closed unmerged), and nothing in that format makes it
refuse one: it loads an export with Hadamard-rotated linears without an error and computes them on
unrotated inputs (benchmarks/reports/export-loaders/export_loaders_*.md has the measured error). vLLM applies the transform.
So the export states it where a reader looks: `config.json["quasar_export"]` and the README.md card.
"""

from __future__ import annotations

from typing import Any

TRANSFORMERS_WRONG = (
    "from_pretrained alone gives wrong outputs without an error: Transformers' compressed-tensors loader ignores "
    "transform_config, so the {count} Hadamard-rotated linears run on unrotated inputs. Apply the transform after "
    "loading (README.md of this folder), or load the Quasar checkpoint this was exported from with quasar_hf"
)
TRANSFORMERS_SNIPPET = """```python
import json
from compressed_tensors.transform import TransformConfig, apply_transform_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

path = "PATH"  # this folder (a Hub repo: huggingface_hub.snapshot_download it first)
model = AutoModelForCausalLM.from_pretrained(path)
transforms = json.load(open(f"{path}/config.json"))["quantization_config"]["transform_config"]
apply_transform_config(model, TransformConfig.model_validate(transforms))  # the rotations, as modules
rotations = {k: v for k, v in load_file(f"{path}/model.safetensors").items() if k.endswith("_input.weight")}
model.load_state_dict(rotations, strict=False)  # their matrices, stored once per width
```"""
TRANSFORMERS_RIGHT = "supported: AutoModelForCausalLM.from_pretrained with compressed-tensors installed"
VLLM = "vllm serve PATH (applies transform_config; on vLLM's CPU backend install quasar-hf beside vLLM for its plugin)"


def loading_block(rotated_modules: list[str], version: str) -> dict[str, Any]:
    """config.json["quasar_export"]: the exporter and, per loader, whether it reads this export right."""
    transformers = TRANSFORMERS_WRONG.format(count=len(rotated_modules)) if rotated_modules else TRANSFORMERS_RIGHT
    return {
        "exported_by": f"quasar_hf {version}",
        "rotated_modules": len(rotated_modules),
        "vllm": VLLM,
        "transformers": transformers,
    }


def export_card(name: str, quantized: int, ignored: list[str], rotated_modules: list[str], version: str) -> str:
    """README.md of an export: the layout, then how to load it (and how not to)."""
    block = loading_block(rotated_modules, version)
    transformers_recipe = f"\n{TRANSFORMERS_SNIPPET.replace('PATH', name)}\n" if rotated_modules else ""
    rotated = (
        f"{len(rotated_modules)} linears (`{rotated_modules[0].rsplit('.', 1)[-1]}` and any others listed in "
        "`transform_config`) quantize a Hadamard-rotated input, stored as a compressed-tensors input transform."
        if rotated_modules
        else "No linear takes a rotated input (no `transform_config`)."
    )
    return f"""---
tags:
- quasar-hf
- w8a8
- int8
- compressed-tensors
---

# {name}

A Quasar W8A8 verifier exported by {block["exported_by"]} in the compressed-tensors `int-quantized`
layout: {quantized} linears hold symmetric per-channel INT8 weights and quantize their inputs
dynamically per token to INT8; kept in high precision: {", ".join(f"`{n}`" for n in ignored) or "none"}.
{rotated}

## Loading

- **vLLM**: {block["vllm"].replace("PATH", name)}.
- **Transformers**: {block["transformers"].replace("(README.md of this folder)", "as below")}.
{transformers_recipe}
`config.json["quasar_export"]` says the same for programs.
"""
