"""Megatron's run arguments that change what a checkpoint's weights mean, and what a Megatron preset does with
each.

A Megatron preset's table maps the weights of one configuration: rotary embeddings over whole heads that
rotate each head's two halves, RMSNorm, SwiGLU, no linear biases. Megatron-LM keeps its arguments in the
checkpoint (``args`` in ``common.pt``, or in megatron-core 0.19's ``common_state`` object); NeMo 2 keeps the
model's megatron-core ``TransformerConfig`` in ``context/model.yaml``. :func:`run_args` reads either under
Megatron-LM's names, and :func:`for_run` checks them against :data:`ARGS`: a value the table maps as it is
passes; one it maps after an adjustment (the rotary row order of ``rotary_interleaved``) changes the preset; any
other is refused in one line naming the argument, its value and what it changes. An argument the run does not
state is not checked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.manifest import ObjectEntry
from ..errors import UsageError
from ..formats.dcp import DcpIO
from ..formats.megatron import (
    COMMON,
    COMMON_STATE,
    COMMON_STATE_KEY,
    CONTEXT,
    MODEL_YAML,
    config_of_args,
    hf_fields,
    nemo2_root,
    read_common,
    read_config,
    read_model_yaml,
)
from .preset import ModelShape, Preset, Row, model_shape

__all__ = ["ARGS", "MEGATRON_SIDE", "Arg", "RunArgs", "args_config", "common_objects", "for_run", "run_args"]

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
    Arg("quick_geglu", (False, None), "a gated quick-GELU MLP (GPT-OSS's), not SwiGLU"),
    Arg("swiglu", (True,), "linear_fc1 without the gate and up rows of SwiGLU"),
    Arg("glu_linear_offset", (None, 0.0), "an offset added to the GLU's linear half (GPT-OSS's 1.0)"),
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


# megatron-core's TransformerConfig (NeMo 2's model.yaml) -> Megatron-LM's argument of the same meaning.
_CONFIG_NAMES = {
    "layernorm_epsilon": "norm_epsilon", "seq_length": "max_position_embeddings", "num_moe_experts": "num_experts",
    "layernorm_zero_centered_gamma": "apply_layernorm_1p", "rope_scaling": "use_rope_scaling",
}


def _target(value: Any) -> str:
    """The name NeMo's YAML gives a class, function or dtype (``{_target_: torch.bfloat16}``), else the value's."""
    return str(value.get("_target_", "")) if isinstance(value, dict) else str(getattr(value, "name", value))


def _from_transformer_config(config: dict) -> dict[str, Any]:
    """NeMo 2's ``TransformerConfig`` fields as Megatron-LM's arguments."""
    out = {_CONFIG_NAMES.get(k, k): v for k, v in config.items() if not k.startswith("_")}
    activation = _target(config.get("activation_func")).rpartition(".")[2]
    if "gated_linear_unit" in config:
        out["swiglu"] = bool(config["gated_linear_unit"]) and activation == "silu"
        out["squared_relu"] = activation == "squared_relu"
        out["quick_geglu"] = bool(config["gated_linear_unit"]) and activation == "quick_gelu"
    if "share_embeddings_and_output_weights" in config:
        out["untie_embeddings_and_output_weights"] = not config["share_embeddings_and_output_weights"]
    groups = config.get("num_query_groups")
    out["group_query_attention"] = groups is not None and groups != config.get("num_attention_heads")
    if "params_dtype" in config:
        out["params_dtype"] = _target(config["params_dtype"]).rpartition(".")[2]
    return out


def common_objects(root: Path) -> tuple[str, list[ObjectEntry]]:
    """The common state's non-tensor entries of the megatron-core checkpoint ``root``
    (:func:`ckptkit.formats.megatron.read_common`), and where they were read, for a reader that wants its run
    arguments alone. ``common.pt`` is read by itself; a megatron-core 0.19 checkpoint's ``.metadata`` first, to
    find the object.

    Raises:
        FormatError, UnsafeCheckpointError: the common state cannot be read.
    """
    if (root / COMMON).is_file():
        return str(root / COMMON), read_common(root, ())[1]
    manifest = DcpIO().read_part(root, lambda _: ())
    return f"{root}'s {COMMON_STATE_KEY}", [o for o in manifest.objects if o.sidecar == COMMON_STATE]


def args_config(root: Path) -> dict | None:
    """The model's counts from the ``args`` (Megatron-LM's run arguments) in the common state of ``root``, under
    HF ``config.json``'s field names; None where ``root`` is no megatron-core checkpoint or holds no ``args``.

    Raises:
        FormatError, UnsafeCheckpointError: as :func:`common_objects`.
    """
    if read_config(root) is None:
        return None
    return config_of_args(next((o.value for o in common_objects(root)[1] if o.path == ("args",)), None))


def run_args(src: Path | None, given: dict[str, Any] | None = None) -> RunArgs | None:
    """The run's arguments of the Megatron checkpoint ``src``: Megatron-LM's ``args`` in its ``common.pt``, else
    NeMo 2's ``context/model.yaml`` above its ``weights/``; ``given`` (``--megatron-args``) added over them.
    None where there are none.

    Raises:
        FormatError, UnsafeCheckpointError: ``common.pt`` or ``model.yaml`` cannot be read.
    """
    found: RunArgs | None = None
    if src is not None and src.is_dir() and read_config(src) is not None:
        where, common = common_objects(src)
        args = next((o.value for o in common if o.path == ("args",)), None)
        if args is not None and hasattr(args, "__dict__") and hasattr(args, "num_layers"):
            found = RunArgs(dict(vars(args)), f"{where}'s args")
        elif (root := nemo2_root(src)) is not None and (config := read_model_yaml(root)) is not None:
            found = RunArgs(_from_transformer_config(config), str(root / CONTEXT / MODEL_YAML))
    if given:
        values = {**(found.values if found else {}), **given}
        found = RunArgs(values, f"{found.source} and --megatron-args" if found else "--megatron-args")
    return found


def for_run(p: Preset, shape: ModelShape | None, args: RunArgs | None) -> tuple[Preset, ModelShape | None,
                                                                             tuple[str, ...]]:
    """Preset ``p`` (a Megatron one) and the model's shape as the run's ``args`` make them, with notes; a shape
    the config did not give comes from the arguments' counts.

    Raises:
        UsageError: an argument's value the preset does not map, naming the argument, its value and why.
    """
    if p.other_side != MEGATRON_SIDE or args is None:
        return p, shape, ()
    if shape is None and "num_attention_heads" in args.values:
        counts = hf_fields(args.values)
        shape = model_shape(counts, args.source, counts.get("tie_word_embeddings"))
    notes: list[str] = []
    accepted = dict(p.run_args)
    for arg in ARGS:
        if arg.name not in args.values or (arg.when and not args.get(arg.when)):
            continue
        value = args.get(arg.name)
        if arg.row is not None:
            _check_row(p, arg, value or (args.get(arg.also) if arg.also else None), args)
            continue
        how = next((how for v, how in arg.adjust if v == value), None)
        if how is not None:
            p, shape, note = _ADJUST[how](p, shape, arg, value, args)
            notes += [note] if note else []
        elif value not in accepted.get(arg.name, arg.accepted):
            raise UsageError(f"--preset {p.name}: {arg.name} {value!r} ({args.source}) means {arg.means}; the preset's "
                             "table does not map that model")
    return p, shape, tuple(notes)


def _check_row(p: Preset, arg: Arg, value: Any, args: RunArgs) -> None:
    """Refuses a preset whose table maps ``*arg.row`` tensors where the run has none, or the other way round."""
    assert arg.row is not None
    has = bool(value)
    if has == _maps(p, arg.row):
        return
    from .registry import PRESETS  # the registry loads the families' tables, which import this layer

    nearest = [q.name for q in PRESETS.values()
               if q.other_side == MEGATRON_SIDE and q is not p and _maps(q, arg.row) == has]
    hint = f" (--preset {' or '.join(nearest)} {'maps' if has else 'leaves out'} them)" if nearest else ""
    maps = f"the table {'maps no' if has else 'expects'} {arg.row} tensors"
    raise UsageError(f"--preset {p.name}: {arg.name} {value!r} ({args.source}), but {maps}{hint}")


def _maps(p: Preset, suffix: str) -> bool:
    return any(o.endswith(suffix) for r in p.rows for o in r.other)


_QK = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias")


def _rotary(p: Preset, shape: ModelShape | None, arg: Arg, value: Any, args: RunArgs
            ) -> tuple[Preset, ModelShape | None, str | None]:
    """``rotary_interleaved``: q and k rotate adjacent pairs of each head, as Meta's Llama does; HF rotates
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
