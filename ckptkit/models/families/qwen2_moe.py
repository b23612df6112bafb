"""Qwen2-MoE (HF ``qwen2_moe``): q/k/v biases; MoE layers with routed experts and one gated shared expert
(megatron-core's ``shared_experts`` with ``gate_weight``, HF's ``shared_expert`` and ``shared_expert_gate``);
dense layers (``mlp_only_layers``) where the config says so. megatron-core's GPT <-> HF."""

from __future__ import annotations

from ..family import Family, HfModel
from ..preset import Row
from ._mcore import EXPERTS_MLP, HF, MLP, common, gated_mlp, gqa, megatron_preset, moe, post_attention_norm

__all__ = ["FAMILY"]


def _rows() -> tuple[Row, ...]:
    shared = [*moe(EXPERTS_MLP, "mlp:moe"), *gated_mlp(HF + "mlp.shared_expert.", MLP + "shared_experts.",
                                                        group="mlp:moe"),
              Row(HF + "mlp.shared_expert_gate.weight", (MLP + "shared_experts.gate_weight",), stacked="n",
                  group="mlp:moe")]
    return tuple(common() + gqa(False, True) + post_attention_norm() + shared
                 + gated_mlp(HF + "mlp.", MLP, group="mlp:dense"))


FAMILY = Family(
    "qwen2_moe",
    presets=(megatron_preset("megatron-qwen2-moe", "megatron-core GPT with q/k/v biases, routed experts and a gated "
                             "shared expert <-> HF Qwen2-MoE", _rows(), "qwen2_moe"),),
    hf=(HfModel("qwen2_moe", "Qwen2MoeForCausalLM", tied=False),),
    rank=5,
)
