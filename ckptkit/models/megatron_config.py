"""An HF ``config.json`` made from a Megatron run's arguments, for an export given no ``--hf-assets``.

Megatron-LM's ``args`` (``common.pt``) and NeMo 2's ``context/model.yaml`` state the model's sizes
(:func:`ckptkit.models.megatron_args.run_args` reads both under Megatron-LM's names). :func:`hf_config` writes
the config.json of the preset's family from them, field by field as :data:`_FIELDS` says, with two exceptions:
``vocab_size`` is the exported embedding's rows (Megatron pads the tokenizer's vocabulary to a multiple of
``make_vocab_size_divisible_by`` times the tensor-parallel size, and transformers wants the rows), and the
values that :data:`ckptkit.models.megatron_args.ARGS` has already pinned (SwiGLU's ``silu``, no MLP bias) are
written as they are. An argument the config needs and the run does not state is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from ..core.manifest import TensorEntry
from ..errors import UsageError
from .megatron_args import RunArgs
from .preset import Preset

__all__ = ["ARCHITECTURES", "hf_config"]

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
"""The families whose config.json is made here (``model_type`` -> transformers' class)."""

_FIELDS = (  # (config.json's field, Megatron-LM's argument): stated by every run
    ("num_hidden_layers", "num_layers"), ("hidden_size", "hidden_size"), ("intermediate_size", "ffn_hidden_size"),
    ("num_attention_heads", "num_attention_heads"), ("rms_norm_eps", "norm_epsilon"),
    ("max_position_embeddings", "max_position_embeddings"),
)
_MOE_FIELDS = (("num_experts", "num_experts"), ("num_experts_per_tok", "moe_router_topk"),
               ("moe_intermediate_size", "moe_ffn_hidden_size"))
_MIXTRAL_FIELDS = (("num_local_experts", "num_experts"), ("num_experts_per_tok", "moe_router_topk"),
                   ("intermediate_size", "moe_ffn_hidden_size"))
"""Mixtral's: its ``intermediate_size`` is an expert's (it has no dense MLP)."""
_EMBEDDING = "model.embed_tokens.weight"
_ROPE_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""megatron-core's Llama 3 rope scaling, whose constants Megatron-LM does not expose as arguments."""


def _required(args: RunArgs, name: str, field: str) -> Any:
    value = args.get(name)
    if value is None or isinstance(value, bool):
        raise UsageError(f"{args.source} state no {name}; the generated config.json's {field} needs it: pass "
                         "--hf-assets DIR with the model's config.json")
    return value


def _dtype(args: RunArgs) -> str | None:
    if args.get("bf16"):
        return "bfloat16"
    if args.get("fp16"):
        return "float16"
    named = args.get("params_dtype")
    name = str(getattr(named, "name", named) or "").removeprefix("torch.")
    return name or None


def _rope(args: RunArgs) -> dict[str, Any]:
    base = float(_required(args, "rotary_base", "rope_theta"))
    if not args.get("use_rope_scaling"):
        return {"rope_type": "default", "rope_theta": base}
    factor = float(args.get("rope_scaling_factor") or 8.0)
    return {"rope_type": "llama3", "factor": factor, **_ROPE_LLAMA3, "rope_theta": base}


def hf_config(args: RunArgs, p: Preset, tensors: Sequence[TensorEntry]) -> tuple[dict, str] | None:
    """The config.json of preset ``p``'s family for the exported ``tensors`` (HF names), from the run's ``args``,
    and a note saying where each field came from; None where ckptkit makes no config for the family.

    Raises:
        UsageError: the run's arguments lack a field the config needs (the message names it), or describe layers
            the family's config cannot (dense layers among MoE ones).
    """
    model_type = next((t for t in p.model_types if t in ARCHITECTURES), None)
    if model_type is None:
        return None
    config: dict[str, Any] = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type}
    config.update({field: _required(args, name, field) for field, name in _FIELDS})
    heads = config["num_attention_heads"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    config["num_key_value_heads"] = groups or heads
    config["head_dim"] = args.get("kv_channels") or config["hidden_size"] // heads
    embedding = next((t for t in tensors if t.key == _EMBEDDING), None)
    if embedding is None:
        raise UsageError(f"no {_EMBEDDING} among the exported tensors; the generated config.json's vocab_size is its "
                         "rows: pass --hf-assets DIR with the model's config.json")
    config["vocab_size"] = embedding.shape[0]
    untie = args.get("untie_embeddings_and_output_weights")
    if not isinstance(untie, bool):
        _required(args, "untie_embeddings_and_output_weights", "tie_word_embeddings")
    config["tie_word_embeddings"] = not untie
    rope = _rope(args)
    config.update(rope_parameters=rope, rope_theta=rope["rope_theta"], hidden_act="silu",
                  attention_bias=bool(args.get("add_qkv_bias")), attention_dropout=0.0)
    config.update({"mlp_bias": False} if model_type == "llama" else {})
    moe = {"qwen3_moe": _MOE_FIELDS, "mixtral": _MIXTRAL_FIELDS}.get(model_type, ())
    if moe:
        config.update(_moe(args, moe, renormalized=model_type == "mixtral"))
    dtype = _dtype(args)
    config.update({"dtype": dtype, "torch_dtype": dtype} if dtype else {})
    stated = [f for f in _FIELDS if f[0] not in dict(moe)] + [_stated(args, f) for f in moe]
    said = ", ".join(f"{field} <- {name}" for field, name in stated)
    note = (f"config.json ({model_type}) made from {args.source}: {said}, num_key_value_heads <- num_query_groups, "
            "head_dim <- kv_channels, rope_theta <- rotary_base, tie_word_embeddings <- not "
            f"untie_embeddings_and_output_weights; vocab_size {config['vocab_size']} <- the rows of {_EMBEDDING} "
            "(the padded vocabulary); no tokenizer files: copy them from the model's release")
    return config, note


def _stated(args: RunArgs, pair: tuple[str, str]) -> tuple[str, str]:
    """(field, argument): Megatron-LM leaves ``moe_ffn_hidden_size`` unset when it is ``ffn_hidden_size``."""
    field, name = pair
    return (field, "ffn_hidden_size") if name == "moe_ffn_hidden_size" and args.get(name) is None else pair


def _moe(args: RunArgs, fields: tuple[tuple[str, str], ...], renormalized: bool) -> dict[str, Any]:
    """A MoE family's routing fields: every layer an MoE layer; top-k probabilities renormalized unless
    Megatron's router took the softmax over all experts first (``moe_router_pre_softmax``), which Qwen3-MoE
    says with ``norm_topk_prob`` and Mixtral (always renormalized, ``renormalized``) cannot say."""
    freq = args.get("moe_layer_freq")
    if freq not in (None, 1) and not (isinstance(freq, list) and all(f == 1 for f in freq)):
        raise UsageError(f"moe_layer_freq {freq!r:.60} ({args.source}): dense layers among the MoE ones are not in "
                         "the generated config.json; pass --hf-assets DIR with the model's config.json")
    out = {field: _required(args, name, field) for field, name in map(partial(_stated, args), fields)}
    if renormalized:
        if args.get("moe_router_pre_softmax"):
            raise UsageError(f"moe_router_pre_softmax True ({args.source}): Mixtral renormalizes its top-k "
                             "probabilities, which that router does not; pass --hf-assets DIR with the model's "
                             "config.json")
        return out
    return {**out, "norm_topk_prob": not args.get("moe_router_pre_softmax"), "decoder_sparse_step": 1,
            "mlp_only_layers": []}
