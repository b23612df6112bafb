"""Mistral (HF ``mistral``): HF's own names checked as they are (every key known, none missing); megatron-core's
GPT maps it with Llama's table (:mod:`.llama`)."""

from __future__ import annotations

from ..family import Family, HfModel
from ..preset import Preset
from ._rows import hf_names

__all__ = ["FAMILY"]

FAMILY = Family(
    "mistral",
    presets=(Preset("mistral", "HF Mistral (and Llama) names, checked: every key known, none missing", "Mistral",
                    hf_names(biases=False), dropped=("model.layers.{n}.self_attn.rotary_emb.inv_freq",)),),
    hf=(HfModel("mistral", "MistralForCausalLM", tied=False),),
    rank=11,
)
