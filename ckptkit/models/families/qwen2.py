"""Qwen2 and Qwen2.5 (HF ``qwen2``): Llama with q/k/v biases. HF's own names checked as they are, and
megatron-core's GPT <-> HF."""

from __future__ import annotations

from ..family import Family, HfModel
from ..megatron_args import MegatronRules
from ..preset import Preset
from ._mcore import gpt, megatron_preset
from ._mcore_config import GptConfig
from ._rows import hf_names

__all__ = ["FAMILY"]

FAMILY = Family(
    "qwen2",
    presets=(
        megatron_preset("megatron-qwen2", "megatron-core GPT with q/k/v biases <-> HF Qwen2, Qwen2.5", gpt(bias=True),
                        "qwen2"),
        Preset("qwen2", "HF Qwen2 names, checked: every key known, none missing (q/k/v biases included)", "Qwen2",
               hf_names(biases=True), dropped=("model.layers.{n}.self_attn.rotary_emb.inv_freq",)),
    ),
    hf=(HfModel("qwen2", "Qwen2ForCausalLM", tied=False),),
    megatron=MegatronRules(configs=(("qwen2", GptConfig("qwen2", "Qwen2ForCausalLM")),)),
    rank=1,
)
