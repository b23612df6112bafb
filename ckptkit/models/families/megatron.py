"""megatron-core's GPT names in a ``torch_dist`` checkpoint <-> HF.

Every ``decoder.layers.*`` tensor stacks the layers along dim 0 (experts' along dims 0 and 1), or, in a model
whose layers differ (``moe_layer_freq``: DeepSeek-V3's first dense layers), is saved once per layer
(``decoder.layers.0.mlp.linear_fc1.weight``): each table reads and writes both spellings (``layer_prefix``).
``linear_qkv`` holds, per query group, its q rows, then its k rows, then its v rows (its bias likewise);
``linear_fc1`` the gate rows, then the up rows; each norm is named after the layer it precedes (TE's fused
``layer_norm_weight``; the local spec saves it under the same name) or, read too, its own module's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..preset import Preset, Row

__all__ = ["PRESETS", "REFUSED"]

_HF = "model.layers.{n}."
_MG = "decoder.layers."
_ATTN, _MLP = _MG + "self_attention.", _MG + "mlp."
_QKV = ((("heads_per_group", "head_dim"), ("head_dim",), ("head_dim",)))


@dataclass(frozen=True)
class _Experts:
    """How an HF family names a MoE layer's router and routed experts (below ``model.layers.{n}.``)."""

    router: str
    expert: str
    """The prefix of expert ``{e}``'s projections."""
    gate_up_down: tuple[str, str, str]


_QWEN_EXPERTS = _Experts("mlp.gate.weight", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj"))
_MIXTRAL_EXPERTS = _Experts("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2"))


def _common() -> list[Row]:
    return [Row("model.embed_tokens.weight", ("embedding.word_embeddings.weight",)),
            Row("model.norm.weight", ("decoder.final_layernorm.weight",)),
            Row("lm_head.weight", ("output_layer.weight",), tied_to="model.embed_tokens.weight")]


def _gqa(norms: bool, bias: bool) -> list[Row]:
    """The fused q/k/v attention with its input norm; ``norms``: Qwen3's q/k norms; ``bias``: Qwen2's q/k/v
    biases."""
    norm = (_ATTN + "linear_qkv.layer_norm_weight", _MG + "input_layernorm.weight")
    rows = [Row(_HF + "input_layernorm.weight", norm, stacked="n"),
            Row(tuple(_HF + f"self_attn.{x}_proj.weight" for x in "qkv"), (_ATTN + "linear_qkv.weight",), stacked="n",
                split=_QKV, groups="n_kv_heads"),
            Row(_HF + "self_attn.o_proj.weight", (_ATTN + "linear_proj.weight",), stacked="n")]
    if bias:
        rows.append(Row(tuple(_HF + f"self_attn.{x}_proj.bias" for x in "qkv"), (_ATTN + "linear_qkv.bias",),
                        stacked="n", split=_QKV, groups="n_kv_heads"))
    if norms:
        rows += [Row(_HF + f"self_attn.{x}_norm.weight", (_ATTN + f"{x}_layernorm.weight",), stacked="n") for x in "qk"]
    return rows


def _mla() -> list[Row]:
    """Multi-latent attention (DeepSeek-V3) with its input norm, in the local spec's names (the TE spec's,
    which fuse the q/kv norms into the up projections, read too); q either projected at once or through a
    low-rank ``q_lora_rank`` (``q:plain``, ``q:lora``)."""
    def row(hf: str, *other: str, group: str | None = None) -> Row:
        return Row(_HF + hf, tuple(_ATTN + o for o in other), stacked="n", group=group)

    return [Row(_HF + "input_layernorm.weight", (_MG + "input_layernorm.weight",), stacked="n"),
            row("self_attn.kv_a_proj_with_mqa.weight", "linear_kv_down_proj.weight"),
            row("self_attn.kv_a_layernorm.weight", "kv_layernorm.weight", "linear_kv_up_proj.layer_norm_weight"),
            row("self_attn.kv_b_proj.weight", "linear_kv_up_proj.weight"),
            row("self_attn.o_proj.weight", "linear_proj.weight"),
            row("self_attn.q_proj.weight", "linear_q_proj.weight", group="q:plain"),
            row("self_attn.q_a_proj.weight", "linear_q_down_proj.weight", group="q:lora"),
            row("self_attn.q_a_layernorm.weight", "q_layernorm.weight", "linear_q_up_proj.layer_norm_weight",
                group="q:lora"),
            row("self_attn.q_b_proj.weight", "linear_q_up_proj.weight", group="q:lora")]


def _swiglu(hf: str, mg: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
            group: str | None = None, stacked: str = "n") -> list[Row]:
    """A gated MLP: HF's gate, up and down (below ``hf``) <-> megatron-core's ``linear_fc1`` (gate rows, then up
    rows) and ``linear_fc2`` (below ``mg``)."""
    gate, up, down = names
    return [Row((f"{hf}{gate}.weight", f"{hf}{up}.weight"), (mg + "linear_fc1.weight",), stacked=stacked,
                group=group),
            Row(f"{hf}{down}.weight", (mg + "linear_fc2.weight",), stacked=stacked, group=group)]


def _post_attention_norm(group: str | None = None) -> list[Row]:
    return [Row(_HF + "post_attention_layernorm.weight", (_MLP + "linear_fc1.layer_norm_weight",
                                                          _MG + "pre_mlp_layernorm.weight"), stacked="n", group=group)]


def _moe(experts: _Experts, group: str | None = None) -> list[Row]:
    """A MoE layer's router and routed experts (megatron-core's stacked per layer and expert)."""
    return [Row(_HF + experts.router, (_MLP + "router.weight",), stacked="n", group=group),
            *_swiglu(_HF + experts.expert, _MLP + "experts.experts.", experts.gate_up_down, group, "n,e")]


def _megatron(norms: bool = False, experts: _Experts | None = None, bias: bool = False,
              dense: bool = True) -> tuple[Row, ...]:
    """A Llama-shaped GPT: ``norms``: Qwen3's q/k norms; ``experts``: MoE layers named so in HF, and, with
    ``dense``, dense layers too where the config says so (Qwen3-MoE's ``mlp_only_layers``); ``bias``: q/k/v
    biases."""
    rows = _common() + _gqa(norms, bias) + _post_attention_norm()
    if experts is None:
        return tuple(rows + _swiglu(_HF + "mlp.", _MLP))
    if not dense:
        return tuple(rows + _moe(experts))
    return tuple(rows + _moe(experts, "mlp:moe") + _swiglu(_HF + "mlp.", _MLP, group="mlp:dense"))


def _qwen2_moe() -> tuple[Row, ...]:
    """Qwen2-MoE: q/k/v biases; MoE layers with routed experts and one gated shared expert (megatron-core's
    ``shared_experts`` with ``gate_weight``, HF's ``shared_expert`` and ``shared_expert_gate``); dense layers
    (``mlp_only_layers``) where the config says so."""
    moe = [*_moe(_QWEN_EXPERTS, "mlp:moe"), *_swiglu(_HF + "mlp.shared_expert.", _MLP + "shared_experts.",
                                                     group="mlp:moe"),
           Row(_HF + "mlp.shared_expert_gate.weight", (_MLP + "shared_experts.gate_weight",), stacked="n",
               group="mlp:moe")]
    return tuple(_common() + _gqa(False, True) + _post_attention_norm() + moe
                 + _swiglu(_HF + "mlp.", _MLP, group="mlp:dense"))


def _deepseek() -> tuple[Row, ...]:
    """DeepSeek-V3: multi-latent attention; its first layers dense, the rest MoE with
    shared experts (no gate) and the router's expert bias (HF's ``e_score_correction_bias``)."""
    moe = [*_moe(_QWEN_EXPERTS, "mlp:moe"),
           *_swiglu(_HF + "mlp.shared_experts.", _MLP + "shared_experts.", group="mlp:moe"),
           Row(_HF + "mlp.gate.e_score_correction_bias", (_MLP + "router.expert_bias",), stacked="n", group="mlp:moe")]
    # The local spec names the norm before each MLP pre_mlp_layernorm; TE fuses a dense layer's into linear_fc1.
    norm = Row(_HF + "post_attention_layernorm.weight", (_MG + "pre_mlp_layernorm.weight",
                                                         _MLP + "linear_fc1.layer_norm_weight"), stacked="n")
    return tuple(_common() + _mla() + [norm] + moe + _swiglu(_HF + "mlp.", _MLP, group="mlp:dense"))


def _gpt_oss() -> tuple[Row, ...]:
    """GPT-OSS: q/k/v and output biases, each head's attention sink (megatron-core's learnable softmax offset);
    every layer MoE, with a router bias and experts with biases. HF holds each layer's experts in one tensor,
    ``gate_up_proj`` ``[experts, hidden, 2 x ffn]`` with gate and up columns interleaved: megatron-core's
    ``linear_fc1`` ``[experts, 2 x ffn, hidden]`` (gate rows, then up rows) transposed and interleaved."""
    experts = _MLP + "experts.experts."

    def row(hf: str, other: str, transpose: bool = False, interleave: bool = False) -> Row:
        return Row(_HF + hf, (other,), stacked="n", transpose=transpose, interleave=interleave)

    return tuple(_common() + _gqa(False, True) + _post_attention_norm() + [
        row("self_attn.o_proj.bias", _ATTN + "linear_proj.bias"),
        row("self_attn.sinks", _ATTN + "core_attention.softmax_offset"),
        row("mlp.router.weight", _MLP + "router.weight"), row("mlp.router.bias", _MLP + "router.bias"),
        row("mlp.experts.gate_up_proj", experts + "linear_fc1.weight", transpose=True, interleave=True),
        row("mlp.experts.gate_up_proj_bias", experts + "linear_fc1.bias", interleave=True),
        row("mlp.experts.down_proj", experts + "linear_fc2.weight", transpose=True),
        row("mlp.experts.down_proj_bias", experts + "linear_fc2.bias")])


def _preset(name: str, summary: str, rows: tuple[Row, ...], *model_types: str, **more: Any) -> Preset:
    return Preset(name, summary, "Megatron", rows, model_types=model_types, layer_prefix=_MG, **more)


_GPT_OSS_RUN = (("add_bias_linear", (True,)), ("softmax_type", ("learnable",)), ("swiglu", (False,)),
                ("quick_geglu", (True,)), ("glu_linear_offset", (1.0,)), ("position_embedding_type", ("yarn", "rope")))
"""Megatron-LM's arguments of a GPT-OSS run (``--quick-geglu``, ``--softmax-type learnable``, YaRN): its
clamped, offset activation, sliding windows and YaRN scaling are the HF config's to state, not the weights'."""


PRESETS = (
    _preset("megatron-llama", "megatron-core GPT (torch_dist: layer-stacked or per-layer, fused QKV per query group, "
            "fused gate/up) <-> HF Llama 3, Mistral", _megatron(), "llama", "mistral"),
    _preset("megatron-qwen2", "megatron-core GPT with q/k/v biases <-> HF Qwen2, Qwen2.5", _megatron(bias=True),
            "qwen2"),
    _preset("megatron-qwen3", "megatron-core GPT with q/k layer norms <-> HF Qwen3", _megatron(norms=True), "qwen3"),
    _preset("megatron-qwen3-moe", "megatron-core GPT with q/k layer norms and routed experts (stacked per layer "
            "and expert) <-> HF Qwen3-MoE", _megatron(norms=True, experts=_QWEN_EXPERTS), "qwen3_moe"),
    _preset("megatron-mixtral", "megatron-core GPT with routed experts and no q/k norms <-> HF Mixtral",
            _megatron(experts=_MIXTRAL_EXPERTS, dense=False), "mixtral"),
    _preset("megatron-qwen2-moe", "megatron-core GPT with q/k/v biases, routed experts and a gated shared expert "
            "<-> HF Qwen2-MoE", _qwen2_moe(), "qwen2_moe"),
    _preset("megatron-deepseek-v3", "megatron-core GPT with multi-latent attention, dense then MoE layers (per-layer "
            "keys), shared experts and the router's expert bias <-> HF DeepSeek-V3",
            _deepseek(), "deepseek_v3"),
    _preset("megatron-gpt-oss", "megatron-core GPT with q/k/v and output biases, attention sinks (learnable softmax "
            "offset) and routed experts with biases (gate/up rows <-> HF's transposed, interleaved gate_up_proj) "
            "<-> HF GPT-OSS; MXFP4 experts dequantized on import", _gpt_oss(), "gpt_oss", mxfp4=True,
            run_args=_GPT_OSS_RUN),
)

REFUSED = {
    **dict.fromkeys(("gemma3", "gemma3_text"), "Gemma 3 has no Megatron table: megatron-core 0.16.1 has no layer "
                    "with its extra norms and embedding scaling (Megatron-Bridge adds its own)"),
}
"""``model_type`` -> why ``convert --to megatron`` refuses that family."""
