"""The model families ckptkit adapts, as tables (the format: :mod:`ckptkit.ops.tables`).

Each torchtitan family's table is the inverse of its ``state_dict_adapter.py``'s ``from_hf_map`` in torchtitan
0.3, with the stacked experts (``moe.routed_experts.inner_experts.w1_EFD``, ``[experts, hidden, dim]``) split
into HF's per-expert weights; the keys an adapter's ``to_hf`` leaves out (router load-balancing buffers) are
``dropped``. Older torchtitan spellings are read too.
"""

from __future__ import annotations

from ..errors import UsageError
from .tables import STACK_FIELDS, TRANSFORMS, ModelShape, Preset, Row, model_shape, rotary_rows

__all__ = ["PRESETS", "STACK_FIELDS", "TRANSFORMS", "ModelShape", "Preset", "Row", "model_shape", "preset",
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
)}
"""The presets by name."""


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"--preset {name!r}: unknown; expected one of {', '.join(PRESETS)}") from None
