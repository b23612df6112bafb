"""megatron-core's GPT names in a ``torch_dist`` checkpoint <-> HF."""

from __future__ import annotations

from ..table import Preset, Row

__all__ = ["PRESETS"]

_HF = "model.layers.{n}."
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


PRESETS = (
    Preset("megatron-llama", "megatron-core GPT (torch_dist: layer-stacked, fused QKV per query group, fused "
           "gate/up) <-> HF Llama 3", "Megatron", _megatron(), model_types=("llama",)),
    Preset("megatron-qwen3", "megatron-core GPT with q/k layer norms <-> HF Qwen3", "Megatron", _megatron(norms=True),
           model_types=("qwen3",)),
    Preset("megatron-qwen3-moe", "megatron-core GPT with q/k layer norms and routed experts (stacked per layer "
           "and expert) <-> HF Qwen3-MoE", "Megatron", _megatron(norms=True, experts=True),
           model_types=("qwen3_moe",)),
)
