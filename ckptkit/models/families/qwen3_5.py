"""torchtitan 0.3's Qwen3.5 (``qwen3_5``), dense and MoE <-> HF Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``).

A Qwen3.5 layer is either full attention (gated q, q/k norms: ``self_attn.*``) or GatedDeltaNet linear
attention (``linear_attn.*``), and its MLP dense or MoE (stacked experts, a sigmoid-gated shared expert); a
vision tower and its patch merger sit beside the language model, whose HF names are under
``model.language_model.``. The rows are the inverse of torchtitan 0.3's ``Qwen35StateDictAdapter``, with two
differences of layout:

- HF fuses what torchtitan keeps apart: GatedDeltaNet's ``in_proj_qkv`` and ``conv1d`` (q, k and v rows:
  key heads x key head dim twice, then value heads x value head dim) and the vision attention's ``qkv``;
- the MoE experts follow transformers, which holds them as torchtitan does, output dim before input dim:
  ``gate_up_proj`` ``[experts, 2 x hidden, dim]`` is ``w1_EFD`` then ``w3_EFD`` along dim 1, ``down_proj``
  ``[experts, dim, hidden]`` is ``w2_EDF``. torchtitan 0.3.0's adapter writes both transposed, which
  transformers cannot load; the HF side here is what transformers and the released checkpoints hold.

Vision blocks are numbered ``{v}``.
"""

from __future__ import annotations

from functools import partial

from ..family import Family, HfModel
from ..preset import Buffer, Count, Preset, Row
from ._rows import renames, weights_and_biases
from ._titan import EXPERT_BIAS

__all__ = ["FAMILY"]

_LM, _HF, _T = "model.language_model.", "model.language_model.layers.{n}.", "layers.{n}."
_renames = partial(renames, hf=_HF, other=_T)
_VHF, _VT = "model.visual.blocks.{v}.", "vision_encoder.layers.{v}."


_KEY_ROWS: Count = ("linear_num_key_heads", "linear_key_head_dim")
_QKV_SPLIT: tuple[Count, ...] = (_KEY_ROWS, _KEY_ROWS, ("linear_num_value_heads", "linear_value_head_dim"))

_COMMON = [
    Row(_LM + "embed_tokens.weight", ("tok_embeddings.weight",)), Row(_LM + "norm.weight", ("norm.weight",)),
    Row("lm_head.weight", ("lm_head.weight",), tied_to=_LM + "embed_tokens.weight"),
    *_renames((("input_layernorm.weight", "attention_norm.weight"),
               ("post_attention_layernorm.weight", "ffn_norm.weight"))),
    *_renames(tuple((f"self_attn.{p}.weight", f"attn.{t}.weight") for p, t in
                    (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv"), ("o_proj", "wo"), ("q_norm", "q_norm"),
                     ("k_norm", "k_norm"))), group="attn:full"),
    *[Row(f"{_HF}linear_attn.{fused}.weight", tuple(f"{_T}attn.{part}_{w}.weight" for w in "qkv"), hf_fuses=True,
          split=_QKV_SPLIT, group="attn:linear") for fused, part in (("in_proj_qkv", "in_proj"), ("conv1d", "conv"))],
    *_renames(tuple((f"linear_attn.{n}", f"attn.{n}") for n in
                    ("in_proj_z.weight", "in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias", "norm.weight",
                     "out_proj.weight")), group="attn:linear"),
]
_PATCH = tuple((f"vision_config.{f}",) for f in ("in_channels", "temporal_patch_size", "patch_size", "patch_size"))
_VISION = [
    Row("model.visual.patch_embed.proj.weight", ("vision_encoder.patch_embed.weight",), hf_dims=_PATCH),
    Row("model.visual.patch_embed.proj.bias", ("vision_encoder.patch_embed.bias",)),
    Row("model.visual.pos_embed.weight", ("vision_encoder.pos_embed",)),
    *weights_and_biases((("norm1", "norm1"), ("norm2", "norm2"), ("attn.proj", "attn.proj"),
                         ("mlp.linear_fc1", "mlp.linear_fc1"), ("mlp.linear_fc2", "mlp.linear_fc2")), _VHF, _VT),
    *[Row(f"{_VHF}attn.qkv.{leaf}", tuple(f"{_VT}attn.{w}.{leaf}" for w in ("wq", "wk", "wv")), hf_fuses=True)
      for leaf in ("weight", "bias")],
    *weights_and_biases((("norm", "norm"), ("linear_fc1", "linear_fc1"), ("linear_fc2", "linear_fc2")),
                        "model.visual.merger.", "vision_encoder.merger."),
]
_DENSE = _renames((("mlp.gate_proj.weight", "feed_forward.w1.weight"), ("mlp.up_proj.weight", "feed_forward.w3.weight"),
                   ("mlp.down_proj.weight", "feed_forward.w2.weight")))
_EXPERTS = _T + "moe.routed_experts.inner_experts."
_MOE = [
    Row(_HF + "mlp.experts.gate_up_proj", (_EXPERTS + "w1_EFD", _EXPERTS + "w3_EFD"), hf_fuses=True, fuse_dim=1,
        split=(("moe_intermediate_size",), ("moe_intermediate_size",))),  # a transposed [E, D, 2F] is refused
    Row(_HF + "mlp.experts.down_proj", (_EXPERTS + "w2_EDF",)),
    *_renames((("mlp.gate.weight", "moe.router.gate.weight"),
               ("mlp.shared_expert.gate_proj.weight", "moe.shared_experts.w1.weight"),
               ("mlp.shared_expert.up_proj.weight", "moe.shared_experts.w3.weight"),
               ("mlp.shared_expert.down_proj.weight", "moe.shared_experts.w2.weight"),
               ("mlp.shared_expert_gate.weight", "moe.shared_experts.gate.weight"))),
]
_INV_FREQ = _HF + "self_attn.rotary_emb.inv_freq"

FAMILY = Family(
    "qwen3_5",
    presets=(
        Preset("torchtitan-qwen3.5", "torchtitan's Qwen3.5 (full and GatedDeltaNet attention, vision tower) <-> HF "
               "Qwen3.5", "torchtitan", tuple(_COMMON + _DENSE + _VISION), dropped=(_INV_FREQ,),
               model_types=("qwen3_5",)),
        Preset("torchtitan-qwen3.5-moe", "torchtitan's Qwen3.5-MoE (as Qwen3.5, with stacked experts as transformers "
               "holds them and a gated shared expert) <-> HF Qwen3.5-MoE", "torchtitan",
               tuple(_COMMON + _MOE + _VISION), dropped=(_INV_FREQ,), buffers=(Buffer(EXPERT_BIAS, (("experts",),)),),
               model_types=("qwen3_5_moe",)),
    ),
    hf=(HfModel("qwen3_5"), HfModel("qwen3_5_moe")),
    rank=10,
)
