"""Qwen3 and Qwen3-MoE (HF ``qwen3``, ``qwen3_moe``): Llama with RMSNorm over each head's q and k; the MoE
variant's layers hold routed experts (and dense MLPs where ``mlp_only_layers`` says so). torchtitan's and
megatron-core's names <-> HF."""

from __future__ import annotations

from ..family import Family, HfModel
from ..megatron_args import MegatronRules
from ..preset import Buffer, Preset
from ._mcore import EXPERTS_MLP, gpt, megatron_preset
from ._mcore_config import MOE_FIELDS, GptConfig
from ._titan import EXPERT_BIAS, INV_FREQ, QK_NORMS, dense_mlp, experts, gqa, titan_common

__all__ = ["FAMILY"]

FAMILY = Family(
    "qwen3",
    presets=(
        Preset("torchtitan-qwen3", "torchtitan's Qwen3 (q/k norms) <-> HF Qwen3", "torchtitan",
               tuple(titan_common(QK_NORMS) + gqa() + dense_mlp(None)), dropped=(INV_FREQ,), model_types=("qwen3",)),
        Preset("torchtitan-qwen3-moe", "torchtitan's Qwen3-MoE (stacked experts <-> one weight per expert) <-> HF "
               "Qwen3-MoE", "torchtitan", tuple(titan_common(QK_NORMS) + gqa() + dense_mlp() + experts()),
               dropped=(INV_FREQ,), buffers=(Buffer(EXPERT_BIAS, (("experts",),), group="mlp:moe"),),
               model_types=("qwen3_moe",)),
        megatron_preset("megatron-qwen3", "megatron-core GPT with q/k layer norms <-> HF Qwen3", gpt(norms=True),
                        "qwen3"),
        megatron_preset("megatron-qwen3-moe", "megatron-core GPT with q/k layer norms and routed experts (stacked per "
                        "layer and expert) <-> HF Qwen3-MoE", gpt(norms=True, experts=EXPERTS_MLP), "qwen3_moe"),
    ),
    hf=(HfModel("qwen3", "Qwen3ForCausalLM", tied=False), HfModel("qwen3_moe", "Qwen3MoeForCausalLM", tied=False)),
    megatron=MegatronRules(configs=(("qwen3", GptConfig("qwen3", "Qwen3ForCausalLM")),
                                    ("qwen3_moe", GptConfig("qwen3_moe", "Qwen3MoeForCausalLM", moe=MOE_FIELDS)))),
    reads=(("torchtitan-qwen3-moe", "qwen3"),),
    rank=2,
)
