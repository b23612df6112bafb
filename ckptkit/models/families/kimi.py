"""torchtitan 0.3's Kimi K2.5 (``kimi_k2_7``: Kimi K2.5, K2.6 and K2.7-Code) <-> its HF release.

The language model is DeepSeek-V3's (MLA, dense first layers, routed and shared experts, the router's
correction bias), whose HF names the release nests under ``language_model.``; the MoonViT vision tower and its
projector are the family's own. Each row is the inverse of torchtitan 0.3's ``KimiK25StateDictAdapter``: the
vision attention's q, k and v are one ``wqkv`` tensor in HF (their rows one after another) and three in
torchtitan, and the patch embedding is a ``Conv2d`` weight ``[dim, 3, patch, patch]`` in HF and a ``Linear``
weight ``[dim, 3 * patch * patch]`` in torchtitan (the same bytes). Vision blocks are numbered ``{v}``.
"""

from __future__ import annotations

import dataclasses

from ..family import Family, HfModel
from ..preset import Preset, Row
from ._rows import weights_and_biases
from ._titan import mla_moe_decoder

__all__ = ["FAMILY"]

_LM = "language_model."
_HF, _T = "vision_tower.encoder.blocks.{v}.", "vision_encoder.layers.{v}."
_PATCH = "vision_config.patch_size"


def _language_model() -> list[Row]:
    """DeepSeek-V3's language model's rows with the HF names under ``language_model.``."""
    def nested(name: str) -> str:
        return _LM + name
    return [dataclasses.replace(r, hf=tuple(map(nested, r.hf_names)) if isinstance(r.hf, tuple) else nested(r.hf),
                                tied_to=r.tied_to and nested(r.tied_to)) for r in mla_moe_decoder()]


_VISION = [
    Row("vision_tower.patch_embed.proj.weight", ("vision_encoder.patch_embed.weight",),
        hf_dims=((3,), (_PATCH,), (_PATCH,))),
    Row("vision_tower.patch_embed.proj.bias", ("vision_encoder.patch_embed.bias",)),
    Row("vision_tower.patch_embed.pos_emb.weight", ("vision_encoder.pos_embed",)),
    *weights_and_biases((("norm0", "norm1"), ("norm1", "norm2"), ("wo", "attn.proj"), ("mlp.fc0", "mlp.linear_fc1"),
             ("mlp.fc1", "mlp.linear_fc2")), _HF, _T),
    *[Row(f"{_HF}wqkv.{leaf}", tuple(f"{_T}attn.{w}.{leaf}" for w in ("wq", "wk", "wv")), hf_fuses=True)
      for leaf in ("weight", "bias")],
    *weights_and_biases((("vision_tower.encoder.final_layernorm", "vision_encoder.final_norm"),
             ("mm_projector.pre_norm", "vision_encoder.projector.pre_norm"),
             ("mm_projector.proj.0", "vision_encoder.projector.linear_1"),
             ("mm_projector.proj.2", "vision_encoder.projector.linear_2"))),
]

FAMILY = Family(
    "kimi",
    presets=(Preset("torchtitan-kimi-k2.5", "torchtitan's Kimi K2.5 (kimi_k2_7: DeepSeek-V3's language model, MoonViT "
                    "vision tower and projector) <-> its HF release (language_model.*, vision_tower.*, mm_projector.*)",
                    "torchtitan", tuple(_language_model() + _VISION),
                    dropped=(_LM + "model.layers.{n}.self_attn.rotary_emb.inv_freq",), model_types=("kimi_k25",)),),
    hf=(HfModel("kimi_k25"),),
    rank=8,
)
