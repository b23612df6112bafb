"""Mixtral (HF ``mixtral``): routed experts in every layer, no q/k norms. megatron-core's GPT <-> HF."""

from __future__ import annotations

from ..family import Family, HfModel
from ..megatron_args import MegatronRules
from ._mcore import EXPERTS_SPARSE_MOE, gpt, megatron_preset
from ._mcore_config import SPARSE_MOE_FIELDS, GptConfig

__all__ = ["FAMILY"]

FAMILY = Family(
    "mixtral",
    presets=(megatron_preset("megatron-mixtral", "megatron-core GPT with routed experts and no q/k norms <-> HF "
                             "Mixtral", gpt(experts=EXPERTS_SPARSE_MOE, dense=False), "mixtral"),),
    hf=(HfModel("mixtral", "MixtralForCausalLM", tied=False),),
    megatron=MegatronRules(configs=(("mixtral", GptConfig("mixtral", "MixtralForCausalLM", moe=SPARSE_MOE_FIELDS,
                                                          renormalized="Mixtral")),)),
    rank=4,
)
