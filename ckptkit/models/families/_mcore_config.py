"""An HF ``config.json`` made from a Megatron run's arguments, for an export given no ``--hf-assets``: the recipe
a family's Megatron rules name (:class:`GptConfig`, a :data:`ckptkit.models.megatron_args.ConfigBuilder`).

Megatron-LM's ``args`` (``common.pt``) and NeMo 2's ``context/model.yaml`` state the model's sizes
(:class:`ckptkit.models.megatron_args.RunArgs`, under Megatron-LM's names). A recipe writes the family's
config.json from them, field by field as its ``fields`` say, with two exceptions: ``vocab_size`` is the exported
embedding's rows (Megatron pads the tokenizer's vocabulary to a multiple of ``make_vocab_size_divisible_by``
times the tensor-parallel size, and transformers wants the rows), and the values that the arguments checked for
the table have already pinned (SwiGLU's ``silu``, no MLP bias) are written as they are. An argument the config
needs and the run does not state is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...core.manifest import TensorEntry
from ...errors import UsageError
from ..megatron_args import RunArgs, Stated

__all__ = ["FIELDS", "LAYER_NORM_FIELDS", "MOE_FIELDS", "SPARSE_MOE_FIELDS", "GptConfig"]

FIELDS = (  # (config.json's field, Megatron-LM's argument): stated by every run
    ("num_hidden_layers", "num_layers"), ("hidden_size", "hidden_size"), ("intermediate_size", "ffn_hidden_size"),
    ("num_attention_heads", "num_attention_heads"), ("rms_norm_eps", "norm_epsilon"),
    ("max_position_embeddings", "max_position_embeddings"),
)
"""An RMSNorm family's sizes."""
LAYER_NORM_FIELDS = tuple(("norm_epsilon", name) if field == "rms_norm_eps" else (field, name)
                          for field, name in FIELDS)
"""A LayerNorm family's sizes, its epsilon as ``norm_epsilon``."""
MOE_FIELDS = (("num_experts", "num_experts"), ("num_experts_per_tok", "moe_router_topk"),
              ("moe_intermediate_size", "moe_ffn_hidden_size"))
"""The routing of a family whose experts have their own width beside the dense MLP's."""
SPARSE_MOE_FIELDS = (("num_local_experts", "num_experts"), ("num_experts_per_tok", "moe_router_topk"),
                     ("intermediate_size", "moe_ffn_hidden_size"))
"""The routing of a family without a dense MLP: its ``intermediate_size`` is an expert's."""
_EMBEDDING = "model.embed_tokens.weight"
_ROPE_SCALED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""megatron-core's rope scaling (``use_rope_scaling``: HF's ``llama3`` rope type), whose constants Megatron-LM does
not expose as arguments."""


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
    return {"rope_type": "llama3", "factor": factor, **_ROPE_SCALED, "rope_theta": base}


def _stated(args: RunArgs, pair: tuple[str, str]) -> tuple[str, str]:
    """(field, argument): Megatron-LM leaves ``moe_ffn_hidden_size`` unset when it is ``ffn_hidden_size``."""
    field, name = pair
    return (field, "ffn_hidden_size") if name == "moe_ffn_hidden_size" and args.get(name) is None else pair


@dataclass(frozen=True)
class GptConfig:
    """How a GPT-shaped family's ``config.json`` is made from a Megatron run's arguments; called with the
    arguments and the exported tensors (HF names), it returns the config and a note saying where each field
    came from."""

    model_type: str
    architecture: str
    """transformers' class, for ``architectures``."""
    fields: tuple[tuple[str, str], ...] = FIELDS
    """(config.json's field, Megatron-LM's argument) for the sizes every run states."""
    moe: tuple[tuple[str, str], ...] = ()
    """The routing fields of a family with experts (:data:`MOE_FIELDS`, :data:`SPARSE_MOE_FIELDS`); every layer
    is then a MoE layer."""
    renormalized: str | None = None
    """The family's name where its class always renormalizes its top-k probabilities (it has no
    ``norm_topk_prob``), for the refusal of a router that does not."""
    hidden_act: str | None = "silu"
    """The activation the table's checked arguments pin; None: a stated argument gives it."""
    attention_bias: str = "attention_bias"
    """The field that says whether the attention's projections have biases."""
    bias_args: tuple[str, ...] = ("add_qkv_bias",)
    """The arguments any of which gives them biases."""
    head_dim: bool = True
    """The class has a ``head_dim`` field; without one, its head size is ``hidden_size / num_attention_heads``."""
    extra: tuple[tuple[str, Any], ...] = ()
    """Fields written as they are (``mlp_bias``: False)."""
    states: tuple[Stated, ...] = ()
    """Arguments written to the fields that state them (the family's :class:`Stated` arguments)."""

    def __call__(self, args: RunArgs, tensors: Sequence[TensorEntry]) -> tuple[dict, str]:
        """Raises:
            UsageError: the run's arguments lack a field the config needs (the message names it), or describe
                layers the family's config cannot (dense layers among MoE ones).
        """
        config: dict[str, Any] = {"architectures": [self.architecture], "model_type": self.model_type}
        config.update({field: _required(args, name, field) for field, name in self.fields})
        heads = config["num_attention_heads"]
        groups = args.get("num_query_groups") if args.get("group_query_attention") else None
        config["num_key_value_heads"] = groups or heads
        head_dim = args.get("kv_channels") or config["hidden_size"] // heads
        if self.head_dim:
            config["head_dim"] = head_dim
        elif head_dim * heads != config["hidden_size"]:
            raise UsageError(f"kv_channels {head_dim} ({args.source}): {self.model_type}'s config.json has no "
                             f"head_dim, and its heads are hidden_size {config['hidden_size']} / "
                             f"num_attention_heads {heads} wide; the model is not one {self.architecture} computes")
        config["vocab_size"] = _vocabulary(tensors)
        untie = args.get("untie_embeddings_and_output_weights")
        if not isinstance(untie, bool):
            _required(args, "untie_embeddings_and_output_weights", "tie_word_embeddings")
        config["tie_word_embeddings"] = not untie
        rope = _rope(args)
        bias = any(bool(args.get(name)) for name in self.bias_args)
        config.update(rope_parameters=rope, rope_theta=rope["rope_theta"], **self._activation(),
                      **{self.attention_bias: bias}, attention_dropout=0.0)
        config.update(self.extra)
        said = [f for f in self.fields if f[0] not in dict(self.moe)] + [_stated(args, f) for f in self.moe]
        if self.moe:
            config.update(self._moe(args))
        for s in self.states:
            if s.name in args.values:
                config[s.field] = s.field_value(args.get(s.name), args.source)
                said.append((s.field, s.name))
        dtype = _dtype(args)
        config.update({"dtype": dtype, "torch_dtype": dtype} if dtype else {})
        return config, self._note(args, config, said)

    def _activation(self) -> dict[str, Any]:
        return {"hidden_act": self.hidden_act} if self.hidden_act is not None else {}

    def _note(self, args: RunArgs, config: dict, said: list[tuple[str, str]]) -> str:
        fields = ", ".join(f"{field} <- {name}" for field, name in said)
        head_dim = "head_dim <- kv_channels, " if self.head_dim else ""
        return (f"config.json ({self.model_type}) made from {args.source}: {fields}, num_key_value_heads <- "
                f"num_query_groups, {head_dim}rope_theta <- rotary_base, tie_word_embeddings <- not "
                f"untie_embeddings_and_output_weights; vocab_size {config['vocab_size']} <- the rows of {_EMBEDDING} "
                "(the padded vocabulary); no tokenizer files: copy them from the model's release")

    def _moe(self, args: RunArgs) -> dict[str, Any]:
        """A MoE family's routing fields: every layer an MoE layer; top-k probabilities renormalized unless
        Megatron's router took the softmax over all experts first (``moe_router_pre_softmax``), which a family
        with ``norm_topk_prob`` says and one that always renormalizes (``renormalized``) cannot say."""
        freq = args.get("moe_layer_freq")
        if freq not in (None, 1) and not (isinstance(freq, list) and all(f == 1 for f in freq)):
            raise UsageError(f"moe_layer_freq {freq!r:.60} ({args.source}): dense layers among the MoE ones are not in "
                             "the generated config.json; pass --hf-assets DIR with the model's config.json")
        out = {field: _required(args, name, field) for field, name in (_stated(args, f) for f in self.moe)}
        if self.renormalized:
            if args.get("moe_router_pre_softmax"):
                raise UsageError(f"moe_router_pre_softmax True ({args.source}): {self.renormalized} renormalizes its "
                                 "top-k probabilities, which that router does not; pass --hf-assets DIR with the "
                                 "model's config.json")
            return out
        return {**out, "norm_topk_prob": not args.get("moe_router_pre_softmax"), "decoder_sparse_step": 1,
                "mlp_only_layers": []}


def _vocabulary(tensors: Sequence[TensorEntry]) -> int:
    embedding = next((t for t in tensors if t.key == _EMBEDDING), None)
    if embedding is None:
        raise UsageError(f"no {_EMBEDDING} among the exported tensors; the generated config.json's vocab_size is its "
                         "rows: pass --hf-assets DIR with the model's config.json")
    return embedding.shape[0]
