"""Megatron's run arguments that change what a checkpoint's weights mean, and what a Megatron table does with
each.

A Megatron preset's table maps the weights of one configuration, the common one unless it says otherwise:
rotary embeddings over whole heads that rotate each head's two halves, RMSNorm, SwiGLU, no linear biases.
Megatron-LM keeps its arguments in the checkpoint (``args`` in ``common.pt``, or in megatron-core 0.19's
``common_state`` object); NeMo 2 keeps the model's megatron-core ``TransformerConfig`` in ``context/model.yaml``
(:mod:`ckptkit.models.evidence` reads either, as :class:`RunArgs` under Megatron-LM's names).

Every argument is one of three kinds:

- known not to change the forward (:data:`NEUTRAL`: parallelism, recompute, the optimizer, data, logging);
- checked for every Megatron table (:data:`ARGS`, with the values the common configuration takes; a preset's
  ``run_args`` accept others where its table maps them);
- the family's own (its :class:`MegatronRules`: arguments it refuses, ``refuses``, and arguments its
  ``config.json`` states, ``states``).

:func:`for_run` checks a run against a table: a value the table maps as it is passes; one it maps after an
adjustment (the rotary row order of ``rotary_interleaved``) changes the preset; one ``config.json`` states must
agree with the config given; any other is refused in one line naming the argument, its value and what it
changes. An argument the run does not state is not checked. :func:`unclassified` names a run's arguments of
none of the three kinds, which a family's test holds empty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.manifest import TensorEntry
from ..errors import UsageError
from ..formats.megatron import hf_fields
from .preset import Preset, Row
from .shape import ModelShape, model_shape

__all__ = ["ARGS", "MEGATRON_SIDE", "NEUTRAL", "Arg", "ConfigBuilder", "MegatronRules", "RunArgs", "Stated",
           "for_run", "unclassified"]

MEGATRON_SIDE = "Megatron"
"""A Megatron preset's ``other_side``."""


@dataclass(frozen=True, slots=True)
class Arg:
    """One of Megatron-LM's arguments, and the values a Megatron preset maps."""

    name: str
    accepted: tuple[Any, ...] = ()
    """Values the table maps as it is."""
    means: str = ""
    """What any other value changes, for the refusal."""
    adjust: tuple[tuple[Any, str], ...] = ()
    """(value, adjustment in :data:`_ADJUST`) for values the table maps once adjusted."""
    row: str | None = None
    """Instead of ``accepted``: the argument says whether the model has tensors named ``*row`` (True, or a
    count), and the preset's table must map them exactly then."""
    when: str | None = None
    """Checked only where this argument is set (the router's, in a model with experts)."""
    also: str | None = None
    """Another argument that gives the model the ``row`` tensors too (``add_bias_linear``: every linear layer's
    bias, ``linear_qkv``'s included)."""


ARGS = (
    Arg("position_embedding_type", ("rope",), "position embeddings other than rotary ones, which the HF classes of "
        "these families do not have"),
    Arg("rotary_interleaved", (False,), "q/k rows in an order the table does not know", adjust=((True, "rotary"),)),
    Arg("rotary_percent", (1.0,), means="rotary embeddings over part of each head only"),
    Arg("normalization", ("RMSNorm",), "another norm than RMSNorm (LayerNorm has biases and centres)"),
    Arg("apply_layernorm_1p", (False,), "norm weights stored as weight - 1 (zero-centred gamma)"),
    Arg("quick_geglu", (False, None), "a gated quick-GELU MLP, not SwiGLU"),
    Arg("swiglu", (True,), "linear_fc1 without the gate and up rows of SwiGLU"),
    Arg("glu_linear_offset", (None, 0.0), "an offset added to the GLU's linear half"),
    Arg("squared_relu", (False,), "a squared-ReLU MLP, not SwiGLU"),
    Arg("add_bias_linear", (False,), "biases on the linear layers, which the HF classes do not hold"),
    Arg("softmax_type", ("vanilla",), "attention with sinks or an offset softmax"),
    Arg("apply_query_key_layer_scaling", (False, True),  # 1/layer on Q·K^T, undone by the softmax's scale
        "neither true nor false"),
    Arg("untie_embeddings_and_output_weights", means="neither true nor false",
        adjust=((True, "untied"), (False, "tied"))),
    Arg("moe_router_score_function", ("softmax",), "a router scoring experts otherwise than by softmax",
        when="num_experts"),
    Arg("moe_router_topk_scaling_factor", (None, 1.0), "routing weights scaled by a factor", when="num_experts"),
    Arg("mtp_num_layers", (None, 0), "multi-token prediction layers"),
    Arg("add_qkv_bias", row="self_attention.linear_qkv.bias", also="add_bias_linear"),
    Arg("qk_layernorm", row="self_attention.q_layernorm.weight"),
    Arg("multi_latent_attention", row="self_attention.linear_kv_down_proj.weight"),
    Arg("num_experts", row="mlp.experts.experts.linear_fc1.weight"),
    Arg("moe_shared_expert_intermediate_size", row="mlp.shared_experts.linear_fc1.weight"),
    # Last: the rows checked above are named in the layer-stacked spelling this changes.
    Arg("singleton_local_shards", (False,), "neither true nor false", adjust=((True, "singletons"),)),
)
"""The arguments a Megatron preset reads, in the order they are checked; a preset's ``run_args`` replace the
values accepted."""


@dataclass(frozen=True)
class RunArgs:
    """A Megatron run's arguments under Megatron-LM's names, and where they were read."""

    values: dict[str, Any]
    source: str
    """For messages: ``ckpt/common.pt's args``, ``ckpt/context/model.yaml``, ``--megatron-args``."""

    def get(self, name: str) -> Any:
        return self.values.get(name)


NEUTRAL = frozenset({
    # parallelism and where the weights live
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size", "sequence_parallel",
    "data_parallel_size", "world_size", "rank", "local_rank", "use_distributed_optimizer", "overlap_grad_reduce",
    "overlap_param_gather", "distributed_backend", "use_cpu_initialization", "perform_initialization",
    # kernels that compute the same function
    "attention_backend", "apply_rope_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "bias_swiglu_fusion",
    "gradient_accumulation_fusion", "persist_layer_norm", "transformer_impl", "use_flash_attn",
    "attention_softmax_in_fp32", "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_permute_fusion",
    # precision of the run, not of the weights saved
    "bf16", "fp16", "params_dtype", "fp32_residual_connection", "accumulate_allreduce_grads_in_fp32",
    # training: dropout, recompute, the optimizer, the schedule, data, logging, checkpointing
    "hidden_dropout", "attention_dropout", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "optimizer", "lr", "min_lr", "weight_decay", "clip_grad", "adam_beta1", "adam_beta2", "adam_eps",
    "lr_decay_style", "lr_warmup_iters", "train_iters", "micro_batch_size", "global_batch_size", "seed",
    "init_method_std", "seq_length", "encoder_seq_length", "data_path", "split", "log_interval", "save",
    "load", "save_interval", "ckpt_format", "iteration", "consumed_train_samples", "moe_aux_loss_coeff",
    "moe_router_load_balancing_type", "moe_z_loss_coeff",
    # the vocabulary: the embedding's rows are read from the tensor itself
    "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by", "tokenizer_type",
    # sizes that the table's rows and the config carry (checked against the tensors)
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
    "num_query_groups", "kv_channels", "max_position_embeddings", "rotary_base", "norm_epsilon",
    "layernorm_epsilon", "moe_ffn_hidden_size", "moe_router_topk", "moe_layer_freq", "use_rope_scaling",
    "rope_scaling_factor", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_shared_expert_gate",
})
"""Megatron-LM's arguments known not to change what the saved weights compute, or whose value the tensors'
shapes and the config carry: never refused. (Megatron-LM has some 900 arguments; a run's argument that is in no
list passes today, and :func:`unclassified` names it for the family's test.)"""


@dataclass(frozen=True, slots=True)
class Stated:
    """A run argument that ``config.json`` states: written into a config made from the run's arguments, and, where
    a ``config.json`` is given, checked against it. Any value ``values`` lists is honoured."""

    name: str
    """Megatron-LM's argument."""
    field: str
    """The ``config.json`` field that states it."""
    values: tuple[tuple[Any, Any], ...] = ()
    """(the argument's value, the field's) for each value honoured; empty: any value, the field's the same."""
    default: Any = None
    """The field's value where ``config.json`` omits it (its class's default); None: not checked then."""
    means: str = ""
    """What a value not in ``values`` changes, for the refusal."""

    def field_value(self, value: Any, source: str, who: str = "") -> Any:
        """The field's value for the argument's ``value`` (read from ``source``; ``who`` begins the message).

        Raises:
            UsageError: a value the family's config cannot state.
        """
        if not self.values:
            return value
        for arg, field in self.values:
            if arg == value:
                return field
        raise UsageError(f"{who}{self.name} {value!r} ({source}) means {self.means}; the preset's table does not map "
                         "that model")


ConfigBuilder = Callable[["RunArgs", Sequence[TensorEntry]], "tuple[dict, str]"]
"""Makes ``config.json`` (and a note saying where each field came from) from a run's arguments and the exported
tensors (HF names)."""


@dataclass(frozen=True)
class MegatronRules:
    """What a family's Megatron table needs of a run beyond its rows (:attr:`ckptkit.models.family.Family.megatron`)."""

    configs: tuple[tuple[str, ConfigBuilder], ...] = ()
    """(``model_type``, its ``config.json`` builder): the family's configs made from Megatron's arguments, for an
    export given no ``--hf-assets``."""
    states: tuple[Stated, ...] = ()
    """Arguments the family's ``config.json`` states (``rotary_percent`` as ``partial_rotary_factor``)."""
    refuses: tuple[Arg, ...] = ()
    """The family's own arguments that change the forward, beyond :data:`ARGS`, with the values its table maps."""
    no_table: str | None = None
    """Why ``convert --to megatron`` refuses the family: it has no Megatron table."""

    def config_builder(self, p: Preset) -> ConfigBuilder | None:
        """The builder of the first of ``p``'s ``model_type`` values that has one."""
        made = dict(self.configs)
        return next((made[t] for t in p.model_types if t in made), None)


def for_run(p: Preset, shape: ModelShape | None, args: RunArgs | None, rules: MegatronRules | None = None, *,
            config: dict | None = None, kin: Sequence[Preset] = ()
            ) -> tuple[Preset, ModelShape | None, tuple[str, ...]]:
    """Preset ``p`` (a Megatron one) and the model's shape as the run's ``args`` make them, with notes; a shape
    the config did not give comes from the arguments' counts.

    Args:
        p: the preset.
        shape: the model's shape from its config, or None.
        args: the run's arguments, or None (nothing is checked).
        rules: the family's own (:class:`MegatronRules`): the arguments it refuses and those its config states.
        config: the ``config.json`` given (not one made from the arguments), which what ``rules`` states must
            agree with.
        kin: the Megatron presets, named where one of them maps what ``p`` does not.

    Returns:
        The preset, the shape and notes for the report.

    Raises:
        UsageError: an argument's value the preset does not map, naming the argument, its value and why.
    """
    if p.other_side != MEGATRON_SIDE or args is None:
        return p, shape, ()
    if shape is None and "num_attention_heads" in args.values:
        counts = hf_fields(args.values)
        shape = model_shape(counts, args.source, counts.get("tie_word_embeddings"))
    rules = rules or MegatronRules()
    notes: list[str] = []
    accepted = dict(p.run_args)
    stated = {s.name for s in rules.states}
    for arg in (*ARGS, *rules.refuses):
        if arg.name not in args.values or arg.name in stated or (arg.when and not args.get(arg.when)):
            continue
        value = args.get(arg.name)
        if arg.row is not None:
            _check_row(p, arg, value or (args.get(arg.also) if arg.also else None), args, kin)
            continue
        how = next((how for v, how in arg.adjust if v == value), None)
        if how is not None:
            p, shape, note = _ADJUST[how](p, shape, arg, value, args)
            notes += [note] if note else []
        elif value not in accepted.get(arg.name, arg.accepted):
            raise UsageError(f"--preset {p.name}: {arg.name} {value!r} ({args.source}) means {arg.means}; the preset's "
                             "table does not map that model")
    for s in rules.states:
        if s.name in args.values:
            _check_stated(p, s, args, config, shape)
    return p, shape, tuple(notes)


def _check_stated(p: Preset, s: Stated, args: RunArgs, config: dict | None, shape: ModelShape | None) -> None:
    """Refuses a run whose argument ``s`` the family's config states otherwise than the ``config.json`` given."""
    value = s.field_value(args.get(s.name), args.source, f"--preset {p.name}: ")
    found = config.get(s.field, s.default) if config is not None else None
    if found is not None and found != value:
        where = shape.source if shape is not None else "config.json"
        raise UsageError(f"--preset {p.name}: {s.name} {args.get(s.name)!r} ({args.source}) means {s.field} "
                         f"{value!r}, but {where} says {found!r}")


def unclassified(names: Sequence[str], rules: MegatronRules | None = None) -> list[str]:
    """The arguments of ``names`` (a run's) that are neither :data:`NEUTRAL`, nor checked for every table
    (:data:`ARGS`), nor the family's own (``rules``): a family's test holds this empty for the arguments its
    framework's run saves."""
    rules = rules or MegatronRules()
    known = NEUTRAL | {a.name for a in (*ARGS, *rules.refuses)} | {s.name for s in rules.states}
    return sorted(n for n in names if n not in known)


def _check_row(p: Preset, arg: Arg, value: Any, args: RunArgs, kin: Sequence[Preset]) -> None:
    """Refuses a preset whose table maps ``*arg.row`` tensors where the run has none, or the other way round."""
    assert arg.row is not None
    has = bool(value)
    if has == _maps(p, arg.row):
        return
    nearest = [q.name for q in kin if q.other_side == MEGATRON_SIDE and q.name != p.name and _maps(q, arg.row) == has]
    hint = f" (--preset {' or '.join(nearest)} {'maps' if has else 'leaves out'} them)" if nearest else ""
    maps = f"the table {'maps no' if has else 'expects'} {arg.row} tensors"
    raise UsageError(f"--preset {p.name}: {arg.name} {value!r} ({args.source}), but {maps}{hint}")


def _maps(p: Preset, suffix: str) -> bool:
    return any(o.endswith(suffix) for r in p.rows for o in r.other)


_QK = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias")


def _rotary(p: Preset, shape: ModelShape | None, arg: Arg, value: Any, args: RunArgs
            ) -> tuple[Preset, ModelShape | None, str | None]:
    """``rotary_interleaved``: q and k rotate adjacent pairs of each head, as Meta's original code does; HF rotates
    halves. The rotary row gather applies to the q and k parts of the fused ``linear_qkv`` (not v)."""
    rows: list[Row] = []
    for r in p.rows:
        parts = tuple(i for i, n in enumerate(r.hf_names) if n.endswith(_QK))
        if parts and any(o.endswith(("linear_qkv.weight", "linear_qkv.bias")) for o in r.other):
            r = dataclasses.replace(r, transform="rotary", transform_parts=parts if len(r.hf_names) > 1 else None)
        rows.append(r)
    if rows == list(p.rows):
        raise UsageError(f"--preset {p.name}: rotary_interleaved True ({args.source}), but the preset's table has no "
                         "fused linear_qkv to reorder")
    return (dataclasses.replace(p, rows=tuple(rows)), shape,
            f"rotary_interleaved True ({args.source}): q/k rows of linear_qkv in Megatron's interleaved rotary order")


def _tied(p: Preset, shape: ModelShape | None, arg: Arg, value: Any, args: RunArgs
          ) -> tuple[Preset, ModelShape | None, str | None]:
    """``untie_embeddings_and_output_weights``: whether ``output_layer`` is the input embedding."""
    tied = not value
    if shape is None or shape.tied is tied:
        return p, shape, None
    if shape.tied is not None:
        raise UsageError(f"--preset {p.name}: {arg.name} {value!r} ({args.source}), but {shape.source} says "
                         f"tie_word_embeddings {str(shape.tied).lower()}")
    return p, dataclasses.replace(shape, tied=tied), None


def _singletons(p: Preset, shape: ModelShape | None, arg: Arg, value: Any, args: RunArgs
                ) -> tuple[Preset, ModelShape | None, str | None]:
    """``singleton_local_shards``, the flag megatron-core's ``sharded_state_dict`` takes in its metadata: every
    layer's tensors per layer, each expert's its own, a gated ``linear_fc1`` as two (:meth:`Preset.per_layer`)."""
    if p.layer_prefix is None:
        raise UsageError(f"--preset {p.name}: singleton_local_shards True ({args.source}), but the preset's table has "
                         "no layer-stacked names to spell so")
    return (p.per_layer(singletons=True), shape, f"singleton_local_shards True ({args.source}): each layer, expert "
            "and gated linear_fc1 half a tensor of its own, as megatron-core saves with that flag")


_ADJUST = {"rotary": _rotary, "tied": _tied, "untied": _tied, "singletons": _singletons}
