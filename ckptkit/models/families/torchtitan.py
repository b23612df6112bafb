"""torchtitan 0.3's families <-> HF.

Each table is the inverse of the family's ``state_dict_adapter.py`` ``from_hf_map`` in torchtitan 0.3, with the
stacked experts (``moe.routed_experts.inner_experts.w1_EFD``, ``[experts, hidden, dim]``) split into HF's
per-expert weights; the keys an adapter's ``to_hf`` leaves out (router load-balancing buffers) are ``dropped``.
Older torchtitan spellings are read too. ``--preset auto`` picks a table by ``config.json``'s ``model_type``
(``model_types``) or by the keys.
"""

from __future__ import annotations

from ..preset import Buffer, Heads, Preset, Row, Unmapped
from ._llama import META as _META, TITAN as _TITAN, llama_rows, renames

__all__ = ["DEEPSEEK_V3_ROWS", "EXPERT_BIAS", "PRESETS", "UNMAPPED"]

_HF, _T = "model.layers.{n}.", "layers.{n}."


def _titan_common(norms: tuple[tuple[str, str], ...] = ()) -> list[Row]:
    """Embedding, final norm, output head and each layer's two norms, as every torchtitan family names them."""
    return [Row("model.embed_tokens.weight", ("tok_embeddings.weight",)), Row("model.norm.weight", ("norm.weight",)),
            Row("lm_head.weight", ("lm_head.weight", "output.weight"), tied_to="model.embed_tokens.weight"),
            *renames((("input_layernorm.weight", "attention_norm.weight"),
                       ("post_attention_layernorm.weight", "ffn_norm.weight"), *norms))]


def _gqa(biases: bool = False) -> list[Row]:
    """q/k/v (torchtitan 0.3's ``qkv_linear``; earlier ``attention.wq``) and o, in HF's rotary layout."""
    rows = []
    projections: tuple[tuple[str, str, Heads], ...] = (("q", "wq", "n_heads"), ("k", "wk", "n_kv_heads"),
                                                       ("v", "wv", "n_kv_heads"))
    for suffix in ("weight", "bias") if biases else ("weight",):
        rows += [Row(f"{_HF}self_attn.{hf}_proj.{suffix}", (f"{_TITAN}{w}.{suffix}", f"{_META}{w}.{suffix}"),
                     heads=heads) for hf, w, heads in projections]
        rows.append(Row(f"{_HF}self_attn.o_proj.{suffix}", (f"{_T}attention.wo.{suffix}",)))
    return rows


def _dense_mlp(group: str | None = "mlp:dense") -> list[Row]:
    return renames((("mlp.gate_proj.weight", "feed_forward.w1.weight"),
                     ("mlp.up_proj.weight", "feed_forward.w3.weight"),
                     ("mlp.down_proj.weight", "feed_forward.w2.weight")), group=group)


def _experts(group: str = "mlp:moe") -> list[Row]:
    """torchtitan's stacked experts (``[experts, hidden, dim]``; 0.3's ``routed_experts.inner_experts.w1_EFD``,
    0.2's ``experts.w1``) and router."""
    inner = _T + "moe.routed_experts.inner_experts."
    names = (("gate_proj", "w1_EFD"), ("up_proj", "w3_EFD"), ("down_proj", "w2_EDF"))
    return [Row(_HF + f"mlp.experts.{{e}}.{hf}.weight", (inner + titan, f"{_T}moe.experts.{titan[:2]}"),
                stacked="e", group=group) for hf, titan in names] + \
        renames((("mlp.gate.weight", "moe.router.gate.weight"),), group=group)


_QWEN3_NORMS = (("self_attn.q_norm.weight", "attention.q_norm.weight"),
                ("self_attn.k_norm.weight", "attention.k_norm.weight"))
_INV_FREQ = "model.layers.{n}.self_attn.rotary_emb.inv_freq"
EXPERT_BIAS = _T + "moe.expert_bias_E"
"""The router's load-balancing bias: a persistent float32 buffer of torchtitan's MoE, zeros at initialisation,
that HF's Qwen3-MoE and GPT-OSS have no tensor for (DeepSeek-V3's is its ``e_score_correction_bias``)."""
_MLA = renames((("self_attn.kv_a_proj_with_mqa.weight", "attention.wkv_a.weight"),
                 ("self_attn.kv_a_layernorm.weight", "attention.kv_norm.weight"),
                 ("self_attn.kv_b_proj.weight", "attention.wkv_b.weight"),
                 ("self_attn.o_proj.weight", "attention.wo.weight"))) + \
    renames((("self_attn.q_proj.weight", "attention.wq.weight"),), group="q:plain") + \
    renames((("self_attn.q_a_proj.weight", "attention.wq_a.weight"),
              ("self_attn.q_a_layernorm.weight", "attention.q_norm.weight"),
              ("self_attn.q_b_proj.weight", "attention.wq_b.weight")), group="q:lora")
_DEEPSEEK_MOE = _experts() + renames((("mlp.shared_experts.gate_proj.weight", "moe.shared_experts.w1.weight"),
                                       ("mlp.shared_experts.up_proj.weight", "moe.shared_experts.w3.weight"),
                                       ("mlp.shared_experts.down_proj.weight", "moe.shared_experts.w2.weight"),
                                       ("mlp.gate.e_score_correction_bias", "moe.expert_bias_E")), group="mlp:moe")
DEEPSEEK_V3_ROWS = tuple(_titan_common() + _MLA + _dense_mlp() + _DEEPSEEK_MOE)
"""DeepSeek-V3's language model (Kimi K2's too)."""
_OSS = _T + "moe.routed_experts.inner_experts."
_GPT_OSS = [Row(_HF + "self_attn.sinks", (_T + "attention.sinks",)),
            Row(_HF + "mlp.experts.gate_up_proj", (_OSS + "mlp1_weight_EGD", _OSS + "mlp1_weight"), transpose=True),
            Row(_HF + "mlp.experts.gate_up_proj_bias", (_OSS + "mlp1_bias_EG", _OSS + "mlp1_bias")),
            Row(_HF + "mlp.experts.down_proj", (_OSS + "mlp2_weight_EDF", _OSS + "mlp2_weight"), transpose=True),
            Row(_HF + "mlp.experts.down_proj_bias", (_OSS + "mlp2_bias_ED", _OSS + "mlp2_bias")),
            *renames((("mlp.router.weight", "moe.router.gate.weight"), ("mlp.router.bias", "moe.router.gate.bias")))]

PRESETS = (
    Preset("torchtitan-llama", "torchtitan's Llama 3 (0.3 names; 0.1-0.2 names read too) <-> HF Llama, with the "
           "rotary q/k row order", "torchtitan",
           llama_rows((_TITAN + "wq", _META + "wq"), (_TITAN + "wk", _META + "wk"), (_TITAN + "wv", _META + "wv"),
                      ("lm_head.weight", "output.weight"), "rotary"),
           dropped=("freqs_cis", "model.layers.{n}.self_attn.rotary_emb.inv_freq"), model_types=("llama",)),
    Preset("torchtitan-qwen3", "torchtitan's Qwen3 (q/k norms) <-> HF Qwen3", "torchtitan",
           tuple(_titan_common(_QWEN3_NORMS) + _gqa() + _dense_mlp(None)), dropped=(_INV_FREQ,),
           model_types=("qwen3",)),
    Preset("torchtitan-qwen3-moe", "torchtitan's Qwen3-MoE (stacked experts <-> one weight per expert) <-> HF "
           "Qwen3-MoE", "torchtitan", tuple(_titan_common(_QWEN3_NORMS) + _gqa() + _dense_mlp() + _experts()),
           dropped=(_INV_FREQ,), buffers=(Buffer(EXPERT_BIAS, (("experts",),), group="mlp:moe"),),
           model_types=("qwen3_moe",)),
    Preset("torchtitan-deepseek-v3", "torchtitan's DeepSeek-V3 (MLA, shared experts, router correction bias) <-> "
           "HF DeepSeek-V3; FP8 weights dequantized on import", "torchtitan",
           DEEPSEEK_V3_ROWS, dropped=(_INV_FREQ,), fp8=True,
           model_types=("deepseek_v3",)),
    Preset("torchtitan-gpt-oss", "torchtitan's GPT-OSS in bf16 (attention sinks, expert biases; experts "
           "[experts, 2 x hidden, dim] <-> HF's transposed) <-> HF GPT-OSS; MXFP4 experts dequantized on import",
           "torchtitan", tuple(_titan_common() + _gqa(biases=True) + _GPT_OSS), dropped=(_INV_FREQ,),
           buffers=(Buffer(EXPERT_BIAS, (("experts",),)),), mxfp4=True, model_types=("gpt_oss",)),
)

UNMAPPED = (
    Unmapped("torchtitan's flux", "it is a diffusion model, whose Hugging Face form is diffusers' "
             "(FluxTransformer2DModel), not a transformers model", ("FluxTransformer2DModel", "flux"),
             ("img_in.weight", "double_blocks.{n}.img_attn.qkv.weight", "single_blocks.{n}.linear1.weight")),
)
"""torchtitan 0.3's families without a table here."""
