"""DeepSeek-V3 (HF ``deepseek_v3``): multi-latent attention, its first layers dense, the rest MoE with shared
experts and the router's expert bias (HF's ``e_score_correction_bias``). torchtitan's (FP8 weights dequantized on
import) and megatron-core's names <-> HF."""

from __future__ import annotations

from ..family import Family, HfModel
from ..preset import Preset, Row
from ._mcore import EXPERTS_MLP, HF, MG, MLP, common, gated_mlp, megatron_preset, mla, moe
from ._titan import INV_FREQ, mla_moe_decoder

__all__ = ["FAMILY"]


def _megatron() -> tuple[Row, ...]:
    shared = [*moe(EXPERTS_MLP, "mlp:moe"),
              *gated_mlp(HF + "mlp.shared_experts.", MLP + "shared_experts.", group="mlp:moe"),
              Row(HF + "mlp.gate.e_score_correction_bias", (MLP + "router.expert_bias",), stacked="n",
                  group="mlp:moe")]
    # The local spec names the norm before each MLP pre_mlp_layernorm; TE fuses a dense layer's into linear_fc1.
    norm = Row(HF + "post_attention_layernorm.weight", (MG + "pre_mlp_layernorm.weight",
                                                        MLP + "linear_fc1.layer_norm_weight"), stacked="n")
    return tuple(common() + mla() + [norm] + shared + gated_mlp(HF + "mlp.", MLP, group="mlp:dense"))


FAMILY = Family(
    "deepseek_v3",
    presets=(
        Preset("torchtitan-deepseek-v3", "torchtitan's DeepSeek-V3 (MLA, shared experts, router correction bias) <-> "
               "HF DeepSeek-V3; FP8 weights dequantized on import", "torchtitan", mla_moe_decoder(),
               dropped=(INV_FREQ,), fp8=True, model_types=("deepseek_v3",)),
        megatron_preset("megatron-deepseek-v3", "megatron-core GPT with multi-latent attention, dense then MoE layers "
                        "(per-layer keys), shared experts and the router's expert bias <-> HF DeepSeek-V3",
                        _megatron(), "deepseek_v3"),
    ),
    hf=(HfModel("deepseek_v3", "DeepseekV3ForCausalLM", tied=False),),
    rank=6,
)
