"""FLUX (torchtitan's ``flux``): a diffusion model that torchtitan trains and ckptkit does not map; ``--preset
auto`` refuses its checkpoints by name."""

from __future__ import annotations

from ..family import Family, Unmapped

__all__ = ["FAMILY"]

FAMILY = Family(
    "flux",
    unmapped=Unmapped("torchtitan's flux", "it is a diffusion model, whose Hugging Face form is diffusers' "
                      "(FluxTransformer2DModel), not a transformers model", ("FluxTransformer2DModel", "flux"),
                      ("img_in.weight", "double_blocks.{n}.img_attn.qkv.weight", "single_blocks.{n}.linear1.weight")),
)
