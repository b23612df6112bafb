"""torchtitan 0.3's Muse Glimmer (``muse_glimmer``, text and multimodal) <-> HF Muse Glimmer.

The inverse of torchtitan 0.3's ``MuseGlimmerStateDictAdapter``. The text decoder (HF names under
``model.language_model.``) has a gated attention output (torchtitan's ``o_gate``, HF's ``self_attn.gate_proj``)
and four norms a layer; the vision tower (``model.vision_tower.``), its adapter and the projection to the
decoder's width are renames. Both rotate q/k with HF's split-half ``rotate_half`` where torchtitan pairs
adjacent dimensions, so the q/k rows of each head take the rotary row order (the vision tower's with its own
head size, ``vision_config``'s width over its heads). A text-only checkpoint holds no vision rows. Vision
blocks are numbered ``{v}``.
"""

from __future__ import annotations

from ..family import Family, HfModel
from ..preset import Heads, Preset, Row
from ._rows import renames

__all__ = ["FAMILY"]

_LM, _HF, _T = "model.language_model.", "model.language_model.layers.{n}.", "layers.{n}."
_VHF, _VT = "model.vision_tower.layers.{v}.", "vision_encoder.layers.{v}."
_VISION_HEAD = "vision_config.head_dim"
_TOWER = "vision?:tower"
"""The vision rows: all of them, or none (the text-only model)."""


_QK: tuple[tuple[str, str, Heads], ...] = (("q_proj", "wq", "n_heads"), ("k_proj", "wk", "n_kv_heads"))
_TEXT = [
    Row(_LM + "embed_tokens.weight", ("tok_embeddings.embedding.weight",)), Row(_LM + "norm.weight", ("norm.weight",)),
    Row("lm_head.weight", ("lm_head.weight",)),
    *[Row(f"{_HF}self_attn.{hf}.weight", (f"{_T}attention.qkv_linear.{t}.weight",), transform="rotary", heads=heads)
      for hf, t, heads in _QK],
    Row(_HF + "self_attn.v_proj.weight", (_T + "attention.qkv_linear.wv.weight",), heads="n_kv_heads"),
    *renames((("self_attn.o_proj.weight", "attention.wo.weight"), ("self_attn.gate_proj.weight",
                                                                     "attention.o_gate.weight"),
               ("mlp.gate_proj.weight", "feed_forward.w1.weight"), ("mlp.up_proj.weight", "feed_forward.w3.weight"),
               ("mlp.down_proj.weight", "feed_forward.w2.weight"), ("input_layernorm.weight", "attention_norm.weight"),
               ("post_attention_layernorm.weight", "post_attention_norm.weight"),
               ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
               ("post_feedforward_layernorm.weight", "post_ffn_norm.weight")), _HF, _T),
]
_VISION = [
    *renames((("patch_embedder.patch_embedding.weight", "conv1_linear.weight"),
               ("patch_embedder.position_embedding_table.weight", "positional_embedding_vlm"),
               *((f"{ln}.{leaf}", f"{ln}.{leaf}") for ln in ("ln_pre", "ln_post") for leaf in ("weight", "bias"))),
              "model.vision_tower.", "vision_encoder.", _TOWER),
    *[Row(f"{_VHF}attn.{hf}.{leaf}", (f"{_VT}attn.{t}.{leaf}",), transform="rotary", head_dim=_VISION_HEAD,
          group=_TOWER) for hf, t, _ in _QK for leaf in ("weight", "bias")],
    *renames(tuple((f"{hf}.{leaf}", f"{t}.{leaf}") for hf, t in
                    (("attn.v_proj", "attn.wv"), ("attn.proj", "attn.proj"), ("mlp.fc1", "mlp.linear_fc1"),
                     ("mlp.fc2", "mlp.linear_fc2"), ("norm1", "norm1"), ("norm2", "norm2"))
                    for leaf in ("weight", "bias")), _VHF, _VT, _TOWER),
    *renames((("vision_adapter.fc1.weight", "vision_adapter.c_fc.weight"),
               ("vision_adapter.fc2.weight", "vision_adapter.c_proj.weight"),
               ("vision_projection.weight", "vision_projection.weight")), "model.", "", _TOWER),
]

FAMILY = Family(
    "muse_glimmer",
    presets=(Preset("torchtitan-muse-glimmer", "torchtitan's Muse Glimmer (gated attention, rotary q/k row order, "
                    "vision tower, adapter and projection) <-> HF Muse Glimmer", "torchtitan",
                    tuple(_TEXT + _VISION), dropped=(_HF + "self_attn.rotary_emb.inv_freq",),
                    model_types=("muse_glimmer",)),),
    hf=(HfModel("muse_glimmer"),),
    rank=9,
)
