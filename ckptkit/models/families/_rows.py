"""Rows any family's table is built from: renames below a prefix, weight and bias pairs, and the Llama-shaped
table that several families share (torchtitan's and Meta's Llama, and HF's own names checked as they are)."""

from __future__ import annotations

from ..preset import Row

__all__ = ["META", "TITAN", "hf_names", "llama_shaped", "renames", "weights_and_biases"]

TITAN, META = "layers.{n}.attention.qkv_linear.", "layers.{n}.attention."
"""torchtitan 0.3's fused-module prefix of q/k/v, and Meta's (and torchtitan <= 0.2's) attention prefix."""


def renames(pairs: tuple[tuple[str, str], ...], hf: str = "model.layers.{n}.", other: str = "layers.{n}.",
            group: str | None = None) -> list[Row]:
    """Rows that rename a tensor: each (HF name, other side's name) below the prefixes ``hf`` and ``other``."""
    return [Row(hf + a, (other + b,), group=group) for a, b in pairs]


def weights_and_biases(pairs: tuple[tuple[str, str], ...], hf: str = "", other: str = "") -> list[Row]:
    """A weight and a bias row for each (HF module, other side's module) pair, below ``hf`` and ``other``."""
    return [Row(f"{hf}{a}.{leaf}", (f"{other}{b}.{leaf}",)) for a, b in pairs for leaf in ("weight", "bias")]


def llama_shaped(q: tuple[str, ...], k: tuple[str, ...], v: tuple[str, ...], head: tuple[str, ...],
                rotary: str | None, biases: bool = False) -> tuple[Row, ...]:
    """A Llama-shaped table (GQA with rotary q/k, SwiGLU, RMSNorm); the other side's attention names (``q``,
    ``k``, ``v``) and output head vary."""
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


def hf_names(biases: bool) -> tuple[Row, ...]:
    """HF's own names of a Llama-shaped model (with q/k/v biases: Qwen2's)."""
    layer = "model.layers.{n}.self_attn."
    return llama_shaped((layer + "q_proj",), (layer + "k_proj",), (layer + "v_proj",), ("lm_head.weight",), None,
                       biases)
