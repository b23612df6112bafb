"""Rows of megatron-core's GPT names in a ``torch_dist`` checkpoint that the families' Megatron tables are built
from, and :func:`megatron_preset`, which makes a family's Megatron preset.

Every ``decoder.layers.*`` tensor stacks the layers along dim 0 (experts' along dims 0 and 1), or, in a model
whose layers differ (``moe_layer_freq``: dense and MoE layers), is saved once per layer
(``decoder.layers.0.mlp.linear_fc1.weight``): each table reads and writes both spellings (``layer_prefix``).
``linear_qkv`` holds, per query group, its q rows, then its k rows, then its v rows (its bias likewise);
a gated ``linear_fc1`` the gate rows, then the up rows; each norm is named after the layer it precedes (TE's
fused ``layer_norm_weight`` and ``layer_norm_bias``; the local spec saves it under the same name) or, read too,
its own module's name (``input_layernorm``, ``pre_mlp_layernorm``). A LayerNorm has a bias beside its weight
(``norm_bias``); ``add_bias_linear`` gives every linear layer one (``linear_bias``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..megatron_args import MEGATRON_SIDE
from ..preset import Preset, Row

__all__ = ["ATTN", "EXPERTS_MLP", "EXPERTS_SPARSE_MOE", "HF", "MG", "MLP", "Experts", "common", "gated_mlp", "gpt",
           "gqa", "megatron_preset", "mla", "moe", "plain_mlp", "post_attention_norm"]

HF = "model.layers.{n}."
"""HF's prefix of a layer's tensors."""
MG = "decoder.layers."
"""megatron-core's prefix of the layer-stacked tensors."""
ATTN, MLP = MG + "self_attention.", MG + "mlp."
_QKV = ((("heads_per_group", "head_dim"), ("head_dim",), ("head_dim",)))
_LEAVES = {False: ("weight",), True: ("weight", "bias")}


@dataclass(frozen=True)
class Experts:
    """How an HF family names a MoE layer's router and routed experts (below ``model.layers.{n}.``)."""

    router: str
    expert: str
    """The prefix of expert ``{e}``'s projections."""
    gate_up_down: tuple[str, str, str]


EXPERTS_MLP = Experts("mlp.gate.weight", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"))
"""Experts under ``mlp.``: the router ``mlp.gate``, each expert's ``gate_proj``, ``up_proj``, ``down_proj``."""
EXPERTS_SPARSE_MOE = Experts("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2"))
"""Experts under ``block_sparse_moe.``, each expert's ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""


def _norm(hf: str, other: tuple[str, ...], norm_bias: bool, group: str | None = None) -> list[Row]:
    """A norm's weight (and, ``norm_bias``, its bias) under each of the other side's names of its weight."""
    return [Row(hf + "." + leaf, tuple(o.removesuffix("weight") + leaf for o in other), stacked="n", group=group)
            for leaf in _LEAVES[norm_bias]]


def common(norm_bias: bool = False) -> list[Row]:
    """The embedding, the final norm and the output head (tied to the embedding where the config says so)."""
    final = [Row("model.norm.weight", ("decoder.final_layernorm.weight",))]
    if norm_bias:
        final.append(Row("model.norm.bias", ("decoder.final_layernorm.bias",)))
    return [Row("model.embed_tokens.weight", ("embedding.word_embeddings.weight",)), *final,
            Row("lm_head.weight", ("output_layer.weight",), tied_to="model.embed_tokens.weight")]


def gqa(norms: bool, bias: bool, norm_bias: bool = False, linear_bias: bool = False) -> list[Row]:
    """The fused q/k/v attention with its input norm; ``norms``: RMSNorm over each head's q and k; ``bias``:
    q/k/v biases; ``norm_bias``: a LayerNorm's bias; ``linear_bias``: the output projection's bias too."""
    if norm_bias:
        rows = _norm(HF + "input_layernorm", (ATTN + "linear_qkv.layer_norm_weight", MG + "input_layernorm.weight"),
                     True)
    else:
        rows = [Row(HF + "input_layernorm.weight", (ATTN + "linear_qkv.layer_norm_weight",
                                                    MG + "input_layernorm.weight"), stacked="n")]
    rows += [Row(tuple(HF + f"self_attn.{x}_proj.weight" for x in "qkv"), (ATTN + "linear_qkv.weight",), stacked="n",
                 split=_QKV, groups="n_kv_heads"),
             Row(HF + "self_attn.o_proj.weight", (ATTN + "linear_proj.weight",), stacked="n")]
    if bias:
        rows.append(Row(tuple(HF + f"self_attn.{x}_proj.bias" for x in "qkv"), (ATTN + "linear_qkv.bias",),
                        stacked="n", split=_QKV, groups="n_kv_heads"))
    if linear_bias:
        rows.append(Row(HF + "self_attn.o_proj.bias", (ATTN + "linear_proj.bias",), stacked="n"))
    if norms:
        rows += [Row(HF + f"self_attn.{x}_norm.weight", (ATTN + f"{x}_layernorm.weight",), stacked="n") for x in "qk"]
    return rows


def mla() -> list[Row]:
    """Multi-latent attention with its input norm, in the local spec's names (the TE spec's, which fuse the q/kv
    norms into the up projections, read too); q either projected at once or through a low-rank ``q_lora_rank``
    (``q:plain``, ``q:lora``)."""
    def row(hf: str, *other: str, group: str | None = None) -> Row:
        return Row(HF + hf, tuple(ATTN + o for o in other), stacked="n", group=group)

    return [Row(HF + "input_layernorm.weight", (MG + "input_layernorm.weight",), stacked="n"),
            row("self_attn.kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"),
            row("self_attn.kv_a_layernorm.weight", "kv_layernorm.weight", "linear_kv_up_proj.layer_norm_weight"),
            row("self_attn.kv_b_proj.weight", "linear_kv_up_proj.weight"),
            row("self_attn.o_proj.weight", "linear_proj.weight"),
            row("self_attn.q_proj.weight", "linear_q_proj.weight", group="q:plain"),
            row("self_attn.q_a_proj.weight", "linear_q_down_proj.weight", group="q:lora"),
            row("self_attn.q_a_layernorm.weight", "q_layernorm.weight", "linear_q_up_proj.layer_norm_weight",
                group="q:lora"),
            row("self_attn.q_b_proj.weight", "linear_q_up_proj.weight", group="q:lora")]


def gated_mlp(hf: str, mg: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
              group: str | None = None, stacked: str = "n") -> list[Row]:
    """A gated MLP: HF's gate, up and down (below ``hf``) <-> megatron-core's ``linear_fc1`` (gate rows, then up
    rows) and ``linear_fc2`` (below ``mg``)."""
    gate, up, down = names
    return [Row((f"{hf}{gate}.weight", f"{hf}{up}.weight"), (mg + "linear_fc1.weight",), stacked=stacked,
                group=group),
            Row(f"{hf}{down}.weight", (mg + "linear_fc2.weight",), stacked=stacked, group=group)]


def plain_mlp(hf: str, mg: str, names: tuple[str, str] = ("up_proj", "down_proj"), bias: bool = False,
              group: str | None = None) -> list[Row]:
    """An MLP without a gate: HF's up and down projections (below ``hf``) <-> megatron-core's ``linear_fc1`` and
    ``linear_fc2`` (below ``mg``), with their biases where ``bias``."""
    return [Row(f"{hf}{name}.{leaf}", (f"{mg}{fc}.{leaf}",), stacked="n", group=group)
            for name, fc in zip(names, ("linear_fc1", "linear_fc2"), strict=True) for leaf in _LEAVES[bias]]


def post_attention_norm(group: str | None = None, norm_bias: bool = False) -> list[Row]:
    """The norm before the MLP: TE's fused ``linear_fc1.layer_norm_*``, or the local spec's ``pre_mlp_layernorm``."""
    if norm_bias:
        return _norm(HF + "post_attention_layernorm", (MLP + "linear_fc1.layer_norm_weight",
                                                       MG + "pre_mlp_layernorm.weight"), True, group)
    return [Row(HF + "post_attention_layernorm.weight", (MLP + "linear_fc1.layer_norm_weight",
                                                         MG + "pre_mlp_layernorm.weight"), stacked="n", group=group)]


def moe(experts: Experts, group: str | None = None) -> list[Row]:
    """A MoE layer's router and routed experts (megatron-core's stacked per layer and expert)."""
    return [Row(HF + experts.router, (MLP + "router.weight",), stacked="n", group=group),
            *gated_mlp(HF + experts.expert, MLP + "experts.experts.", experts.gate_up_down, group, "n,e")]


def gpt(norms: bool = False, experts: Experts | None = None, bias: bool = False,
        dense: bool = True) -> tuple[Row, ...]:
    """A Llama-shaped GPT: ``norms``: q/k norms; ``experts``: MoE layers named so in HF, and, with ``dense``,
    dense layers too where the config says so (``mlp_only_layers``); ``bias``: q/k/v biases."""
    rows = common() + gqa(norms, bias) + post_attention_norm()
    if experts is None:
        return tuple(rows + gated_mlp(HF + "mlp.", MLP))
    if not dense:
        return tuple(rows + moe(experts))
    return tuple(rows + moe(experts, "mlp:moe") + gated_mlp(HF + "mlp.", MLP, group="mlp:dense"))


def megatron_preset(name: str, summary: str, rows: tuple[Row, ...], *model_types: str, **more: Any) -> Preset:
    """A family's Megatron preset: its rows read and written in both spellings of the layers (``layer_prefix``)."""
    return Preset(name, summary, MEGATRON_SIDE, rows, model_types=model_types, layer_prefix=MG, **more)
