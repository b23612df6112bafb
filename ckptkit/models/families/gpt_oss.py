"""GPT-OSS (HF ``gpt_oss``): q/k/v and output biases, each head's attention sink, every layer MoE with a router
bias and experts with biases. torchtitan's (in bf16; MXFP4 experts dequantized on import) and megatron-core's
names <-> HF.

HF holds each layer's experts in one tensor, ``gate_up_proj`` ``[experts, hidden, 2 x ffn]`` with gate and up
columns interleaved: megatron-core's ``linear_fc1`` ``[experts, 2 x ffn, hidden]`` (gate rows, then up rows)
transposed and interleaved; torchtitan's ``[experts, 2 x hidden, dim]`` transposed.
"""

from __future__ import annotations

from ..family import Family, HfModel
from ..preset import Buffer, Preset, Row
from ._mcore import ATTN, HF, MLP, common, gqa as megatron_gqa, megatron_preset, post_attention_norm
from ._rows import renames
from ._titan import EXPERT_BIAS, INV_FREQ, gqa, titan_common

__all__ = ["FAMILY"]

_T = "layers.{n}."
_OSS = _T + "moe.routed_experts.inner_experts."
_TITAN = [Row(HF + "self_attn.sinks", (_T + "attention.sinks",)),
          Row(HF + "mlp.experts.gate_up_proj", (_OSS + "mlp1_weight_EGD", _OSS + "mlp1_weight"), transpose=True),
          Row(HF + "mlp.experts.gate_up_proj_bias", (_OSS + "mlp1_bias_EG", _OSS + "mlp1_bias")),
          Row(HF + "mlp.experts.down_proj", (_OSS + "mlp2_weight_EDF", _OSS + "mlp2_weight"), transpose=True),
          Row(HF + "mlp.experts.down_proj_bias", (_OSS + "mlp2_bias_ED", _OSS + "mlp2_bias")),
          *renames((("mlp.router.weight", "moe.router.gate.weight"), ("mlp.router.bias", "moe.router.gate.bias")))]


def _megatron() -> tuple[Row, ...]:
    """Each head's attention sink is megatron-core's learnable softmax offset."""
    experts = MLP + "experts.experts."

    def row(hf: str, other: str, transpose: bool = False, interleave: bool = False) -> Row:
        return Row(HF + hf, (other,), stacked="n", transpose=transpose, interleave=interleave)

    return tuple(common() + megatron_gqa(False, True) + post_attention_norm() + [
        row("self_attn.o_proj.bias", ATTN + "linear_proj.bias"),
        row("self_attn.sinks", ATTN + "core_attention.softmax_offset"),
        row("mlp.router.weight", MLP + "router.weight"), row("mlp.router.bias", MLP + "router.bias"),
        row("mlp.experts.gate_up_proj", experts + "linear_fc1.weight", transpose=True, interleave=True),
        row("mlp.experts.gate_up_proj_bias", experts + "linear_fc1.bias", interleave=True),
        row("mlp.experts.down_proj", experts + "linear_fc2.weight", transpose=True),
        row("mlp.experts.down_proj_bias", experts + "linear_fc2.bias")])


_RUN = (("add_bias_linear", (True,)), ("softmax_type", ("learnable",)), ("swiglu", (False,)),
        ("quick_geglu", (True,)), ("glu_linear_offset", (1.0,)), ("position_embedding_type", ("yarn", "rope")))
"""Megatron-LM's arguments of a GPT-OSS run (``--quick-geglu``, ``--softmax-type learnable``, YaRN): its
clamped, offset activation, sliding windows and YaRN scaling are the HF config's to state, not the weights'."""

FAMILY = Family(
    "gpt_oss",
    presets=(
        Preset("torchtitan-gpt-oss", "torchtitan's GPT-OSS in bf16 (attention sinks, expert biases; experts "
               "[experts, 2 x hidden, dim] <-> HF's transposed) <-> HF GPT-OSS; MXFP4 experts dequantized on import",
               "torchtitan", tuple(titan_common() + gqa(biases=True) + _TITAN), dropped=(INV_FREQ,),
               buffers=(Buffer(EXPERT_BIAS, (("experts",),)),), mxfp4=True, model_types=("gpt_oss",)),
        megatron_preset("megatron-gpt-oss", "megatron-core GPT with q/k/v and output biases, attention sinks "
                        "(learnable softmax offset) and routed experts with biases (gate/up rows <-> HF's transposed, "
                        "interleaved gate_up_proj) <-> HF GPT-OSS; MXFP4 experts dequantized on import", _megatron(),
                        "gpt_oss", mxfp4=True, run_args=_RUN),
    ),
    hf=(HfModel("gpt_oss", "GptOssForCausalLM"),),
    rank=7,
)
