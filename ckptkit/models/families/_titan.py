"""Rows of torchtitan 0.3's tables that several families share.

Each family's table is the inverse of its ``state_dict_adapter.py`` ``from_hf_map`` in torchtitan 0.3, with the
stacked experts (``moe.routed_experts.inner_experts.w1_EFD``, ``[experts, hidden, dim]``) split into HF's
per-expert weights; the keys an adapter's ``to_hf`` leaves out (router load-balancing buffers) are ``dropped``.
Older torchtitan spellings are read too.
"""

from __future__ import annotations

from ..preset import Heads, Row
from ._rows import META as _META, TITAN as _TITAN, renames

__all__ = ["EXPERT_BIAS", "INV_FREQ", "QK_NORMS", "dense_mlp", "experts", "gqa", "mla_moe_decoder", "titan_common"]

_HF, _T = "model.layers.{n}.", "layers.{n}."


def titan_common(norms: tuple[tuple[str, str], ...] = ()) -> list[Row]:
    """Embedding, final norm, output head and each layer's two norms, as every torchtitan family names them."""
    return [Row("model.embed_tokens.weight", ("tok_embeddings.weight",)), Row("model.norm.weight", ("norm.weight",)),
            Row("lm_head.weight", ("lm_head.weight", "output.weight"), tied_to="model.embed_tokens.weight"),
            *renames((("input_layernorm.weight", "attention_norm.weight"),
                       ("post_attention_layernorm.weight", "ffn_norm.weight"), *norms))]


def gqa(biases: bool = False) -> list[Row]:
    """q/k/v (torchtitan 0.3's ``qkv_linear``; earlier ``attention.wq``) and o, in HF's rotary layout."""
    rows = []
    projections: tuple[tuple[str, str, Heads], ...] = (("q", "wq", "n_heads"), ("k", "wk", "n_kv_heads"),
                                                       ("v", "wv", "n_kv_heads"))
    for suffix in ("weight", "bias") if biases else ("weight",):
        rows += [Row(f"{_HF}self_attn.{hf}_proj.{suffix}", (f"{_TITAN}{w}.{suffix}", f"{_META}{w}.{suffix}"),
                     heads=heads) for hf, w, heads in projections]
        rows.append(Row(f"{_HF}self_attn.o_proj.{suffix}", (f"{_T}attention.wo.{suffix}",)))
    return rows


def dense_mlp(group: str | None = "mlp:dense") -> list[Row]:
    return renames((("mlp.gate_proj.weight", "feed_forward.w1.weight"),
                     ("mlp.up_proj.weight", "feed_forward.w3.weight"),
                     ("mlp.down_proj.weight", "feed_forward.w2.weight")), group=group)


def experts(group: str = "mlp:moe") -> list[Row]:
    """torchtitan's stacked experts (``[experts, hidden, dim]``; 0.3's ``routed_experts.inner_experts.w1_EFD``,
    0.2's ``experts.w1``) and router."""
    inner = _T + "moe.routed_experts.inner_experts."
    names = (("gate_proj", "w1_EFD"), ("up_proj", "w3_EFD"), ("down_proj", "w2_EDF"))
    return [Row(_HF + f"mlp.experts.{{e}}.{hf}.weight", (inner + titan, f"{_T}moe.experts.{titan[:2]}"),
                stacked="e", group=group) for hf, titan in names] + \
        renames((("mlp.gate.weight", "moe.router.gate.weight"),), group=group)


QK_NORMS = (("self_attn.q_norm.weight", "attention.q_norm.weight"),
            ("self_attn.k_norm.weight", "attention.k_norm.weight"))
"""RMSNorm over each head's q and k, as ``titan_common``'s extra norms."""
INV_FREQ = "model.layers.{n}.self_attn.rotary_emb.inv_freq"
"""The rotary table older HF releases saved: not a weight."""
EXPERT_BIAS = _T + "moe.expert_bias_E"
"""The router's load-balancing bias: a persistent float32 buffer of torchtitan's MoE, zeros at initialisation,
that most HF MoE classes have no tensor for (an HF router's correction bias is one where the class has it)."""
_MLA = renames((("self_attn.kv_a_proj_with_mqa.weight", "attention.wkv_a.weight"),
                 ("self_attn.kv_a_layernorm.weight", "attention.kv_norm.weight"),
                 ("self_attn.kv_b_proj.weight", "attention.wkv_b.weight"),
                 ("self_attn.o_proj.weight", "attention.wo.weight"))) + \
    renames((("self_attn.q_proj.weight", "attention.wq.weight"),), group="q:plain") + \
    renames((("self_attn.q_a_proj.weight", "attention.wq_a.weight"),
              ("self_attn.q_a_layernorm.weight", "attention.q_norm.weight"),
              ("self_attn.q_b_proj.weight", "attention.wq_b.weight")), group="q:lora")
_SHARED_EXPERTS = experts() + renames((("mlp.shared_experts.gate_proj.weight", "moe.shared_experts.w1.weight"),
                                        ("mlp.shared_experts.up_proj.weight", "moe.shared_experts.w3.weight"),
                                        ("mlp.shared_experts.down_proj.weight", "moe.shared_experts.w2.weight"),
                                        ("mlp.gate.e_score_correction_bias", "moe.expert_bias_E")), group="mlp:moe")


def mla_moe_decoder() -> tuple[Row, ...]:
    """Multi-latent attention (q at once, ``q:plain``, or through a low rank, ``q:lora``), dense first layers,
    then routed and shared experts with the router's correction bias: DeepSeek-V3's language model, which other
    families' releases carry too."""
    return tuple(titan_common() + _MLA + dense_mlp() + _SHARED_EXPERTS)
