"""Our Hadamard-rotated linears as compressed-tensors *transforms* (online input rotations).

A RotatedW8A8Linear computes W8A8(x Q) with int8 weights of W Q (ops/hadamard.py). compressed-tensors
describes the same thing as an input transform: `transform_config.config_groups[NAME]` with
`location: "input"` on the module, and a transform weight M stored at `{module}.{NAME}_input.weight`,
applied as x -> x M / sqrt(M.shape[0]) (vLLM's `HadamardTransform`, compressed-tensors'
`HadamardTransform`). Our Q = I_c (x) B / sqrt(b) with B a +-1 Hadamard matrix of order b, so:
  * M = B, stored in the model's float dtype (+-1 is exact in every float dtype);
  * `head_dim = b` when c > 1 (the block-diagonal form), none when c = 1;
  * type "random-hadamard": a Hadamard matrix read from the checkpoint. Not "hadamard", which tells
    vLLM to compute a Sylvester matrix itself (ours is Sylvester x Paley for most widths);
  * one group per block order; its matrix is stored once, at the first module of the group, the way
    llm-compressor saves shared transform weights: loaders share one tensor among the group's modules.
"""

from __future__ import annotations

import torch

from quasar_hf.ops.hadamard import HadamardRotation, sylvester_matrix

TRANSFORM_TYPE = "random-hadamard"
LOCATION = "input"


def hadamard_block(rotation: HadamardRotation) -> torch.Tensor:
    """B, the +-1 matrix [b, b] of one diagonal block (x Q = x (I_c (x) B) / sqrt(b))."""
    return torch.kron(rotation.odd_signs().double(), sylvester_matrix(rotation.pow2).double())


def scheme_name(rotation: HadamardRotation) -> str:
    return f"quasar_hadamard_{rotation.block}"


def transform_tensor_name(module_name: str, rotation: HadamardRotation) -> str:
    return f"{module_name}.{scheme_name(rotation)}_{LOCATION}.weight"


def transform_config_and_tensors(
    rotated: dict[str, HadamardRotation], dtype: torch.dtype
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(transform_config dict, {tensor name: M}) for the rotated modules {name: rotation}, names in order."""
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

    groups: dict[str, list[str]] = {}
    rotations: dict[str, HadamardRotation] = {}
    for name, rotation in rotated.items():
        groups.setdefault(scheme_name(rotation), []).append(name)
        rotations.setdefault(scheme_name(rotation), rotation)
    schemes, tensors = {}, {}
    for group, names in groups.items():
        rotation = rotations[group]
        schemes[group] = TransformScheme(
            type=TRANSFORM_TYPE,
            apply=[TransformArgs(targets=names, location=LOCATION)],
            head_dim=rotation.block if rotation.blocks > 1 else None,
        )
        tensors[transform_tensor_name(names[0], rotation)] = hadamard_block(rotation).to(dtype).contiguous()
    config = TransformConfig(config_groups=schemes).model_dump(mode="json")
    return config, tensors


def apply_transform_reference(x: torch.Tensor, matrix: torch.Tensor, head_dim: int | None) -> torch.Tensor:
    """x M / sqrt(b) in float64 over blocks of `head_dim` (or the whole row): what a loader computes."""
    b = matrix.shape[0]
    z = x.double().unflatten(-1, (-1, head_dim or b))
    return (z @ matrix.double() / b**0.5).flatten(-2)
