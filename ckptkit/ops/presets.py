"""The model families ckptkit adapts, as tables (the format: :mod:`ckptkit.ops.tables`).

Each torchtitan family's table is the inverse of its ``state_dict_adapter.py``'s ``from_hf_map`` in torchtitan
0.3, with the stacked experts (``moe.routed_experts.inner_experts.w1_EFD``, ``[experts, hidden, dim]``) split
into HF's per-expert weights; the keys an adapter's ``to_hf`` leaves out (router load-balancing buffers) are
``dropped``. Older torchtitan spellings are read too.
"""

from __future__ import annotations

from ..errors import UsageError
from .tables import STACK_FIELDS, TRANSFORMS, Heads, ModelShape, Preset, Row, model_shape, rotary_rows

__all__ = ["DETECT", "PRESETS", "STACK_FIELDS", "TRANSFORMS", "ModelShape", "Preset", "Row", "model_shape", "preset",
           "rotary_rows"]


def _llama_rows(q: tuple[str, ...], k: tuple[str, ...], v: tuple[str, ...], head: tuple[str, ...],
                rotary: str | None, biases: bool = False) -> tuple[Row, ...]:
    """The Llama family's table; the other side's attention names (``q``, ``k``, ``v``) and output head vary."""
    layer = "model.layers.{n}."
    rows = [
        Row("model.embed_tokens.weight", ("tok_embeddings.weight",) if rotary else ("model.embed_tokens.weight",)),
        Row(layer + "self_attn.q_proj.weight", tuple(n + ".weight" for n in q), rotary, "n_heads"),
        Row(layer + "self_attn.k_proj.weight", tuple(n + ".weight" for n in k), rotary, "n_kv_heads"),
        Row(layer + "self_attn.v_proj.weight", tuple(n + ".weight" for n in v), None, "n_kv_heads"),
    ]
    if biases:
        rows += [Row(layer + "self_attn.q_proj.bias", tuple(n + ".bias" for n in q), rotary, "n_heads"),
                 Row(layer + "self_attn.k_proj.bias", tuple(n + ".bias" for n in k), rotary, "n_kv_heads"),
                 Row(layer + "self_attn.v_proj.bias", tuple(n + ".bias" for n in v), None, "n_kv_heads")]
    names = (("self_attn.o_proj", "attention.wo"), ("mlp.gate_proj", "feed_forward.w1"),
             ("mlp.up_proj", "feed_forward.w3"), ("mlp.down_proj", "feed_forward.w2"),
             ("input_layernorm", "attention_norm"), ("post_attention_layernorm", "ffn_norm"))
    for hf, other in names:
        name = layer + hf + ".weight"
        rows.append(Row(name, ("layers.{n}." + other + ".weight",) if rotary else (name,)))
    rows.append(Row("model.norm.weight", ("norm.weight",) if rotary else ("model.norm.weight",)))
    rows.append(Row("lm_head.weight", head, tied_to="model.embed_tokens.weight"))
    return tuple(rows)


def _hf_names(biases: bool) -> tuple[Row, ...]:
    layer = "model.layers.{n}.self_attn."
    return _llama_rows((layer + "q_proj",), (layer + "k_proj",), (layer + "v_proj",), ("lm_head.weight",), None,
                       biases)


_TITAN, _META = "layers.{n}.attention.qkv_linear.", "layers.{n}.attention."
_HF, _T = "model.layers.{n}.", "layers.{n}."


def _renames(pairs: tuple[tuple[str, str], ...], group: str | None = None) -> list[Row]:
    """Rows that rename a layer's tensor: (HF name, torchtitan name) below ``model.layers.{n}.``/``layers.{n}.``."""
    return [Row(_HF + hf, (_T + titan,), group=group) for hf, titan in pairs]


def _titan_common(norms: tuple[tuple[str, str], ...] = ()) -> list[Row]:
    """Embedding, final norm, output head and each layer's two norms, as every torchtitan family names them."""
    return [Row("model.embed_tokens.weight", ("tok_embeddings.weight",)), Row("model.norm.weight", ("norm.weight",)),
            Row("lm_head.weight", ("lm_head.weight", "output.weight"), tied_to="model.embed_tokens.weight"),
            *_renames((("input_layernorm.weight", "attention_norm.weight"),
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
    return _renames((("mlp.gate_proj.weight", "feed_forward.w1.weight"),
                     ("mlp.up_proj.weight", "feed_forward.w3.weight"),
                     ("mlp.down_proj.weight", "feed_forward.w2.weight")), group)


def _experts(group: str = "mlp:moe") -> list[Row]:
    """torchtitan's stacked experts (``[experts, hidden, dim]``; 0.3's ``routed_experts.inner_experts.w1_EFD``,
    0.2's ``experts.w1``) and router."""
    inner = _T + "moe.routed_experts.inner_experts."
    names = (("gate_proj", "w1_EFD"), ("up_proj", "w3_EFD"), ("down_proj", "w2_EDF"))
    return [Row(_HF + f"mlp.experts.{{e}}.{hf}.weight", (inner + titan, f"{_T}moe.experts.{titan[:2]}"),
                stacked="e", group=group) for hf, titan in names] + \
        _renames((("mlp.gate.weight", "moe.router.gate.weight"),), group)


_QWEN3_NORMS = (("self_attn.q_norm.weight", "attention.q_norm.weight"),
                ("self_attn.k_norm.weight", "attention.k_norm.weight"))
_INV_FREQ = "model.layers.{n}.self_attn.rotary_emb.inv_freq"
_MLA = _renames((("self_attn.kv_a_proj_with_mqa.weight", "attention.wkv_a.weight"),
                 ("self_attn.kv_a_layernorm.weight", "attention.kv_norm.weight"),
                 ("self_attn.kv_b_proj.weight", "attention.wkv_b.weight"),
                 ("self_attn.o_proj.weight", "attention.wo.weight"))) + \
    _renames((("self_attn.q_proj.weight", "attention.wq.weight"),), "q:plain") + \
    _renames((("self_attn.q_a_proj.weight", "attention.wq_a.weight"),
              ("self_attn.q_a_layernorm.weight", "attention.q_norm.weight"),
              ("self_attn.q_b_proj.weight", "attention.wq_b.weight")), "q:lora")
_DEEPSEEK_MOE = _experts() + _renames((("mlp.shared_experts.gate_proj.weight", "moe.shared_experts.w1.weight"),
                                       ("mlp.shared_experts.up_proj.weight", "moe.shared_experts.w3.weight"),
                                       ("mlp.shared_experts.down_proj.weight", "moe.shared_experts.w2.weight"),
                                       ("mlp.gate.e_score_correction_bias", "moe.expert_bias_E")), "mlp:moe")
_OSS = _T + "moe.routed_experts.inner_experts."
_GPT_OSS = [Row(_HF + "self_attn.sinks", (_T + "attention.sinks",)),
            Row(_HF + "mlp.experts.gate_up_proj", (_OSS + "mlp1_weight_EGD", _OSS + "mlp1_weight"), transpose=True),
            Row(_HF + "mlp.experts.gate_up_proj_bias", (_OSS + "mlp1_bias_EG", _OSS + "mlp1_bias")),
            Row(_HF + "mlp.experts.down_proj", (_OSS + "mlp2_weight_EDF", _OSS + "mlp2_weight"), transpose=True),
            Row(_HF + "mlp.experts.down_proj_bias", (_OSS + "mlp2_bias_ED", _OSS + "mlp2_bias")),
            *_renames((("mlp.router.weight", "moe.router.gate.weight"), ("mlp.router.bias", "moe.router.gate.bias")))]
_MXFP4 = tuple((_HF + f"mlp.experts.{p}_{part}", "GPT-OSS's MXFP4 expert weights are not read; dequantize them first "
                "(transformers: from_pretrained with Mxfp4Config(dequantize=True), then save_pretrained)")
               for p in ("gate_up_proj", "down_proj") for part in ("blocks", "scales"))

_MG = "decoder.layers."
_QKV = ((("heads_per_group", "head_dim"), ("head_dim",), ("head_dim",)))


def _megatron(norms: bool = False, experts: bool = False) -> tuple[Row, ...]:
    """megatron-core's GPT names in a ``torch_dist`` checkpoint: every ``decoder.layers.*`` tensor stacks the
    layers along dim 0 (experts' along dims 0 and 1); ``linear_qkv`` holds, per query group, its q rows, then its
    k rows, then its v rows; ``linear_fc1`` the gate rows, then the up rows; each norm is named after the layer it
    precedes (TE's fused ``layer_norm_weight``; the local spec saves it under the same name) or, read too, its own
    module's name. ``norms``: Qwen3's q/k norms; ``experts``: a Qwen3-MoE layer's router and routed experts."""
    attn, mlp = _MG + "self_attention.", _MG + "mlp."
    rows = [
        Row("model.embed_tokens.weight", ("embedding.word_embeddings.weight",)),
        Row("model.norm.weight", ("decoder.final_layernorm.weight",)),
        Row("lm_head.weight", ("output_layer.weight",), tied_to="model.embed_tokens.weight"),
        Row(_HF + "input_layernorm.weight", (attn + "linear_qkv.layer_norm_weight", _MG + "input_layernorm.weight"),
            stacked="n"),
        Row(tuple(_HF + f"self_attn.{x}_proj.weight" for x in "qkv"), (attn + "linear_qkv.weight",), stacked="n",
            split=_QKV, groups="n_kv_heads"),
        Row(_HF + "self_attn.o_proj.weight", (attn + "linear_proj.weight",), stacked="n"),
        Row(_HF + "post_attention_layernorm.weight", (mlp + "linear_fc1.layer_norm_weight",
                                                      _MG + "pre_mlp_layernorm.weight"), stacked="n"),
    ]
    if norms:
        rows += [Row(_HF + f"self_attn.{x}_norm.weight", (attn + f"{x}_layernorm.weight",), stacked="n") for x in "qk"]
    if not experts:
        return (*rows, Row((_HF + "mlp.gate_proj.weight", _HF + "mlp.up_proj.weight"), (mlp + "linear_fc1.weight",),
                           stacked="n"),
                Row(_HF + "mlp.down_proj.weight", (mlp + "linear_fc2.weight",), stacked="n"))
    expert = _HF + "mlp.experts.{e}."
    return (*rows, Row(_HF + "mlp.gate.weight", (mlp + "router.weight",), stacked="n"),
            Row((expert + "gate_proj.weight", expert + "up_proj.weight"), (mlp + "experts.experts.linear_fc1.weight",),
                stacked="n,e"),
            Row(expert + "down_proj.weight", (mlp + "experts.experts.linear_fc2.weight",), stacked="n,e"))


PRESETS = {p.name: p for p in (
    Preset("torchtitan-llama", "torchtitan's Llama 3 (0.3 names; 0.1-0.2 names read too) <-> HF Llama, with the "
           "rotary q/k row order", "torchtitan",
           _llama_rows((_TITAN + "wq", _META + "wq"), (_TITAN + "wk", _META + "wk"), (_TITAN + "wv", _META + "wv"),
                       ("lm_head.weight", "output.weight"), "rotary"),
           dropped=("freqs_cis", "model.layers.{n}.self_attn.rotary_emb.inv_freq")),
    Preset("meta-llama", "Meta's original Llama names (consolidated.00.pth, params.json; also Mistral's "
           "consolidated files and torchtitan <= 0.2) <-> HF Llama, with the rotary q/k row order", "Meta",
           _llama_rows((_META + "wq",), (_META + "wk",), (_META + "wv",), ("output.weight",), "rotary"),
           dropped=("rope.freqs", "model.layers.{n}.self_attn.rotary_emb.inv_freq"), single_file=True),
    Preset("qwen2", "HF Qwen2 names, checked: every key known, none missing (q/k/v biases included)", "Qwen2",
           _hf_names(biases=True), dropped=("model.layers.{n}.self_attn.rotary_emb.inv_freq",)),
    Preset("mistral", "HF Mistral (and Llama) names, checked: every key known, none missing", "Mistral",
           _hf_names(biases=False), dropped=("model.layers.{n}.self_attn.rotary_emb.inv_freq",)),
    Preset("torchtitan-qwen3", "torchtitan's Qwen3 (q/k norms) <-> HF Qwen3", "torchtitan",
           tuple(_titan_common(_QWEN3_NORMS) + _gqa() + _dense_mlp(None)), dropped=(_INV_FREQ,)),
    Preset("torchtitan-qwen3-moe", "torchtitan's Qwen3-MoE (stacked experts <-> one weight per expert) <-> HF "
           "Qwen3-MoE", "torchtitan", tuple(_titan_common(_QWEN3_NORMS) + _gqa() + _dense_mlp() + _experts()),
           dropped=(_INV_FREQ, _T + "moe.expert_bias_E")),
    Preset("torchtitan-deepseek-v3", "torchtitan's DeepSeek-V3 (MLA, shared experts, router correction bias) <-> "
           "HF DeepSeek-V3; FP8 weights dequantized on import", "torchtitan",
           tuple(_titan_common() + _MLA + _dense_mlp() + _DEEPSEEK_MOE), dropped=(_INV_FREQ,), fp8=True),
    Preset("torchtitan-gpt-oss", "torchtitan's GPT-OSS in bf16 (attention sinks, expert biases; experts "
           "[experts, 2 x hidden, dim] <-> HF's transposed) <-> HF GPT-OSS; MXFP4 refused", "torchtitan",
           tuple(_titan_common() + _gqa(biases=True) + _GPT_OSS), dropped=(_INV_FREQ, _T + "moe.expert_bias_E"),
           refuse=_MXFP4),
    Preset("megatron-llama", "megatron-core GPT (torch_dist: layer-stacked, fused QKV per query group, fused "
           "gate/up) <-> HF Llama 3", "Megatron", _megatron()),
    Preset("megatron-qwen3", "megatron-core GPT with q/k layer norms <-> HF Qwen3", "Megatron", _megatron(norms=True)),
    Preset("megatron-qwen3-moe", "megatron-core GPT with q/k layer norms and routed experts (stacked per layer "
           "and expert) <-> HF Qwen3-MoE", "Megatron", _megatron(norms=True, experts=True)),
)}
"""The presets by name."""

DETECT = {"llama": "torchtitan-llama", "qwen3": "torchtitan-qwen3", "qwen3_moe": "torchtitan-qwen3-moe",
          "deepseek_v3": "torchtitan-deepseek-v3", "gpt_oss": "torchtitan-gpt-oss"}
"""``config.json``'s ``model_type`` -> the preset ``--preset auto`` uses for torchtitan names of that family
(:mod:`ckptkit.ops.detect`)."""


MEGATRON = {"llama": "megatron-llama", "qwen3": "megatron-qwen3", "qwen3_moe": "megatron-qwen3-moe"}
"""``config.json``'s ``model_type`` -> the preset ``convert --to megatron`` uses when given none."""


def preset(name: str) -> Preset:
    """The preset named ``name``.

    Raises:
        UsageError: no preset has that name.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"--preset {name!r}: unknown; expected one of {', '.join(PRESETS)}") from None
