"""Model adapters as declarative tables: how another code base's tensors (torchtitan's, Meta's, Megatron's)
become Hugging Face's, and back.

A :class:`Preset` is a table of :class:`Row`\\ s. Nothing here reads a file or imports torch:
:mod:`ckptkit.models.apply` applies a table to a manifest's entries, building each output tensor from byte
ranges of the input (:mod:`ckptkit.core.reshape`) or as a computed tensor (a transpose, an FP8
dequantization), so that an adapted model streams like any conversion.

The table format. A row names one tensor of the other side and the HF tensor(s) it is:

- ``hf``: the HF name, or a tuple of names when the other side fuses several HF tensors into one (a fused
  ``linear_qkv``; gate and up in one ``linear_fc1``). Names hold placeholders: ``{n}`` a layer number, ``{e}``
  an expert number (any ``{x}``: a number).
- ``other``: the other side's spellings, newest first: the first is written, all are read (older releases).
- ``stacked``: a placeholder of the HF names that the other side's names lack: the other tensor stacks the HF
  tensors along a leading dim 0 indexed by it (``"e"``: torchtitan's ``[experts, hidden, dim]``
  experts; ``"n"``: Megatron's layer-stacked ``decoder.layers.*``). Its size is :meth:`ModelShape.value` of
  :data:`STACK_FIELDS` (``experts``, ``layers``); a tensor whose dim 0 disagrees with the config is refused.
  Several placeholders, comma-separated, stack along as many leading dims, outermost first (``"n,e"``:
  Megatron's experts, ``[layers, experts, rows, hidden]``).
- ``split``: with several ``hf`` names, the rows of each part, each a product of shape fields and integers
  (``(("heads_per_group", "head_dim"), ("head_dim",), ("head_dim",))``); None: equal parts. ``groups`` (a shape
  field) repeats the parts that many times down the rows: Megatron's ``linear_qkv`` holds, per query group,
  its q rows, then its k rows, then its v rows.
- ``transform``: a row gather from :data:`TRANSFORMS` (``"rotary"``), applied to each HF part (or to those
  ``transform_parts`` names) on the way to HF and inverted on the way back; ``heads`` checks the rows against
  the config's head count.
- ``transpose``: the other side holds the transpose (last two dims) of HF's tensor; computed tile by tile.
- ``interleave``: HF's last dim takes in turn the elements of the two halves that the other side holds one after
  the other (GPT-OSS's experts: gate and up columns interleaved in HF, gate rows then up rows in megatron-core's
  ``linear_fc1``); on the way to HF after any transpose, on the way back before it; computed box by box.
- ``hf_fuses``: the reverse of a tuple ``hf``: HF's one tensor is the other side's tensors, all of ``other``
  in order, one after another along dim ``fuse_dim`` (0; or 1 under a leading expert dim); ``split`` gives
  their sizes (None: equal). Kimi's and Qwen3.5's vision ``qkv``; Qwen3.5's ``gate_up_proj`` ``[E, 2F, D]``.
- ``hf_dims``: HF's dims past the first, which the other side holds flattened into one (a convolution's
  kernel as a linear layer's row); each a row count as in ``split``. Moves no byte.
- ``group``: ``"slot:variant"``. A layer holds exactly one variant of each slot, and all of its rows:
  ``"mlp:dense"`` or ``"mlp:moe"`` (DeepSeek-V3's first dense layers), ``"q:plain"`` or ``"q:lora"``. A
  slot named with a trailing ``?`` may be absent altogether (``"vision?:tower"``: a text-only checkpoint of
  a multimodal family).
- ``read_only``: a spelling read on the way to HF but never written (an older layout under its own row).
- ``tied_to``: the HF name of the tensor this one may be tied to (``lm_head`` to the embedding).

A :class:`Buffer` names a persistent buffer of the other side's model that HF has no tensor for (torchtitan's
router load-balancing ``moe.expert_bias_E``): left out on the way to HF, and written on the way back as the
value the other side's model initialises it to, so that its strict load finds every key of its model.

Two spellings of layer-stacked tensors. A preset with a ``layer_prefix`` (megatron-core's ``decoder.layers.``)
also reads, and writes, each layer's tensors one per layer: the stacked name with the layer number after the
prefix (``decoder.layers.0.mlp.linear_fc1.weight``), stacking one dim fewer (:meth:`Preset.per_layer`), which
is how megatron-core saves a model whose layers differ (dense and MoE ones). With ``singleton_local_shards``
megatron-core also saves each expert on its own and a gated ``linear_fc1`` as two tensors; that spelling is
read too. HF names are written per layer when the layers hold different variants of a slot (``group``),
stacked otherwise.

On import from HF, a preset with ``fp8`` dequantizes each float8 ``X.weight`` with its ``X.weight_scale_inv``
(128x128 blocks) into float32 before the table applies (what torchtitan's DeepSeek-V3 import reads through
torch's ``QuantizedHuggingFaceStorageReader``). A preset with ``mxfp4`` dequantizes each ``X_blocks``
(uint8, two FP4 values a byte, 32 values a block) with its ``X_scales`` (e8m0) into bf16 ``X``, HF's layout of
the tensor (the transpose of the blocks' rows and values, as transformers' ``convert_moe_packed_tensors``
returns it; GPT-OSS's released experts).

The rotary transform. torchtitan's Llama and Meta's original Llama code rotate adjacent pairs ``(2i, 2i+1)``
of each q/k head as complex numbers; Hugging Face's ``rotate_half`` rotates ``(i, i + head_dim/2)``. So the
HF rows of a head are the other code base's rows in the order even, then odd. With ``hd = head_dim``,
``half = hd/2``, HF row ``r = h·hd + j`` is row ``h·hd + 2·(j mod half) + j // half`` of the other's, which
is what torchtitan's ``Llama3StateDictAdapter._permute`` and transformers' ``convert_llama_weights_to_hf.permute``
compute; the inverse, ``_reverse_permute``, takes HF row ``h·hd + (k mod 2)·half + k // 2`` to row ``h·hd + k``.
Only ``head_dim`` enters, so the same map serves q (``num_attention_heads`` heads) and k
(``num_key_value_heads``).

Adding a family is adding a module to :mod:`ckptkit.models.families` with its tables, each naming the
``model_type`` values it is detected by.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import UsageError

__all__ = ["CONFIG_NAMES", "STACK_FIELDS", "TRANSFORMS", "Buffer", "ModelShape", "Preset", "Row", "Unmapped",
           "model_shape", "rotary_rows"]

Heads = Literal["n_heads", "n_kv_heads"]
Count = tuple[str | int, ...]
"""A row count: the product of shape fields (:meth:`ModelShape.value`) and integers."""
STACK_FIELDS = {"e": "experts", "n": "layers"}
"""The shape field that counts each stacking placeholder."""
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


@dataclass(frozen=True, slots=True)
class Row:
    """One tensor of the other side and the HF tensor(s) it is; see the module docstring for each field."""

    hf: str | tuple[str, ...]
    other: tuple[str, ...]
    """The other code base's spellings, newest first: the first is written, all are read."""
    transform: str | None = None
    """A name in :data:`TRANSFORMS`, applied on the way to HF and inverted on the way back."""
    heads: Heads | None = None
    """The head count the tensor's rows hold, ``head_dim`` rows each; checked against the config."""
    tied_to: str | None = None
    """The HF name of the tensor this one may be tied to (``lm_head`` to the input embedding): when the HF side
    lacks it and the config ties them, it is written from that tensor."""
    stacked: str | None = None
    split: tuple[Count, ...] | None = None
    groups: str | None = None
    transpose: bool = False
    interleave: bool = False
    group: str | None = None
    read_only: bool = False
    hf_fuses: bool = False
    fuse_dim: int = 0
    hf_dims: tuple[Count, ...] | None = None
    head_dim: str | None = None
    """The shape field of the head size ``transform`` works in (``vision_config.head_dim``); None: the model's."""
    transform_parts: tuple[int, ...] | None = None
    """With several ``hf`` names, the indices of those the transform applies to (a fused ``linear_qkv``'s q and
    k, not its v); None: all of them."""

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.hf if isinstance(self.hf, tuple) else (self.hf,)

    @property
    def plain(self) -> bool:
        """A rename, perhaps with a row gather: one tensor each side, same shape."""
        return not (self.stacked or isinstance(self.hf, tuple) or self.transpose or self.interleave or self.hf_fuses
                    or self.hf_dims)

    @property
    def stack_axes(self) -> tuple[str, ...]:
        """The placeholders of ``stacked``, outermost dim first."""
        return tuple(self.stacked.split(",")) if self.stacked else ()

    def placeholders(self) -> set[str]:
        return {m for name in self.hf_names for m in _PLACEHOLDER.findall(name)}


@dataclass(frozen=True, slots=True)
class Buffer:
    """A persistent buffer of the other side's model that HF has no tensor for (module docstring)."""

    other: str
    """Its name on the other side, with a ``{n}`` layer placeholder where each layer holds one."""
    shape: tuple[Count, ...]
    """Each dim's size, as a row count (``(("experts",),)``: one float per routed expert)."""
    dtype: str = "float32"
    init: Literal["zeros"] = "zeros"
    """The value the other side's model gives it at initialisation, which an import writes."""
    group: str | None = None
    """Held only by the layers that hold this variant of a slot (``"mlp:moe"``); None: by every layer."""


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    """One line for ``--help`` and the docs."""
    other_side: str
    """What the non-HF names are called in messages (``torchtitan``)."""
    rows: tuple[Row, ...]
    dropped: tuple[str, ...] = ()
    """Names, on either side, of buffers that are not weights (``freqs_cis``): left out, and reported."""
    single_file: bool = False
    """The other side's own checkpoints come as one file per model-parallel rank, which is not read here."""
    fp8: bool = False
    """On import from HF, float8 weights with a ``weight_scale_inv`` are dequantized (module docstring)."""
    mxfp4: bool = False
    """On import from HF, MXFP4 ``X_blocks`` with their ``X_scales`` are dequantized into ``X`` (module docstring)."""
    refuse: tuple[tuple[str, str], ...] = ()
    """(HF name pattern, why): keys refused with that reason (GPT-OSS's MXFP4 ``_blocks``)."""
    buffers: tuple[Buffer, ...] = ()
    """The other side's buffers HF has no tensor for: left out on export, written at their initial value on
    import (module docstring)."""
    model_types: tuple[str, ...] = ()
    """The ``config.json`` ``model_type`` values of the family: detection picks this preset by them for the
    framework's names (:mod:`ckptkit.models.registry`)."""
    layer_prefix: str | None = None
    """The prefix of the other side's layer-stacked names, after which the per-layer spelling puts the layer
    number (module docstring)."""
    run_args: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    """(Megatron-LM argument, the values this table maps) where they differ from the common ones
    (:data:`ckptkit.models.megatron_args.ARGS`): GPT-OSS's linear biases, attention sinks, YaRN, quick GeGLU."""

    def per_layer(self, singletons: bool = False) -> Preset:
        """This table in the per-layer spelling: each row stacked along ``n`` named ``<prefix>{n}.<rest>``
        instead, stacked along its other placeholders only. ``singletons``: megatron-core's
        ``singleton_local_shards`` spelling too, one tensor per expert (``experts.experts.{e}.linear_fc1.weight``)
        and a gated ``linear_fc1`` in two (``weight_w``: the gate, ``weight_v``: the up projection)."""
        prefix = self.layer_prefix
        if prefix is None:
            return self

        def unstacked(r: Row) -> list[Row]:
            if "n" not in r.stack_axes:
                return [r]
            other = tuple(prefix + "{n}." + o.removeprefix(prefix) if o.startswith(prefix) else o for o in r.other)
            axes = [a for a in r.stack_axes if a != "n"]
            if singletons and axes == ["e"]:
                other, axes = tuple(o.rsplit(".", 2)[0] + ".{e}." + ".".join(o.rsplit(".", 2)[1:]) for o in other), []
            row = dataclasses.replace(r, other=other, stacked=",".join(axes) or None)
            if singletons and len(r.hf_names) == 2 and r.split is None and r.groups is None:
                return [dataclasses.replace(row, hf=hf, other=tuple(o + part for o in other))
                        for hf, part in zip(r.hf_names, ("_w", "_v"), strict=True)]
            return [row]

        rows = tuple(row for r in self.rows for row in unstacked(r))
        return dataclasses.replace(self, rows=rows, layer_prefix=None)

    @property
    def identity(self) -> bool:
        """Both sides use HF's names: the preset checks a checkpoint's names rather than changing them."""
        return all(r.other == (r.hf,) and r.transform is None for r in self.rows)

    @property
    def needs_shape(self) -> bool:
        return bool(self.buffers) or any(r.transform or not r.plain for r in self.rows)


@dataclass(frozen=True)
class Unmapped:
    """A family that a framework ships and ckptkit has no table for: ``--preset auto`` refuses it by name, rather
    than writing its tensors under their own names into an HF folder."""

    family: str
    """What the family is, for the message (``torchtitan's flux``)."""
    why: str
    model_types: tuple[str, ...] = ()
    """The ``config.json`` ``model_type`` values (or diffusers' ``_class_name``) that name it."""
    keys: tuple[str, ...] = ()
    """Names, with ``{n}`` placeholders, any of which recognises the family's own checkpoint."""


@dataclass(frozen=True)
class ModelShape:
    """What a preset needs to know of the model, from its config."""

    head_dim: int
    n_heads: int | None = None
    n_kv_heads: int | None = None
    layers: int | None = None
    tied: bool | None = None
    """Whether ``lm_head`` is tied to the input embedding (``tie_word_embeddings``); None: not known."""
    source: str = "config"
    """Where these came from, for messages (``base/config.json``)."""
    experts: int | None = None
    """Routed experts per MoE layer (``num_experts``, ``num_local_experts`` or ``n_routed_experts``)."""
    fields: tuple[tuple[str, int], ...] = field(default=(), compare=False)
    """Every positive integer of the config, by its own name, for table rows that count rows in them."""

    def heads(self, which: Heads) -> int | None:
        return self.n_heads if which == "n_heads" else self.n_kv_heads

    def value(self, name: str, why: str) -> int:
        """The shape field ``name`` (``head_dim``, ``n_heads``, ``n_kv_heads``, ``heads_per_group``, ``layers``,
        ``experts``, or any integer field of the config).

        Raises:
            UsageError: the config does not state it; the message names the field and ``why`` it is needed.
        """
        known: dict[str, int | None] = {"head_dim": self.head_dim, "n_heads": self.n_heads,
                                        "n_kv_heads": self.n_kv_heads, "layers": self.layers,
                                        "experts": self.experts, **dict(self.fields)}
        if self.n_heads and self.n_kv_heads:
            known["heads_per_group"] = self.n_heads // self.n_kv_heads
        value = known.get(name)
        if value is None:
            raise UsageError(f"{self.source}: states no {CONFIG_NAMES.get(name, name)}; {why} needs it "
                             "(pass --hf-assets DIR with the model's config.json)")
        return value

    def count(self, factors: Count, why: str) -> int:
        return math.prod(f if isinstance(f, int) else self.value(f, why) for f in factors)


CONFIG_NAMES = {"experts": "num_experts (or num_local_experts, n_routed_experts)", "layers": "num_hidden_layers",
                "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
                "heads_per_group": "num_attention_heads and num_key_value_heads"}
"""A shape field (:meth:`ModelShape.value`) -> the config.json field(s) that state it, for messages."""


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_shape(config: dict, source: str, tied: bool | None = None) -> ModelShape:
    """Head counts from an HF ``config.json`` (its ``text_config`` for a composite model) or Meta's
    ``params.json`` (fields under ``model`` in some releases). ``head_dim`` is the config's own where it
    states one (Mistral-Nemo's differs from ``hidden_size / num_attention_heads``). The integer fields of the
    config's sub-configs are fields too, by their dotted name (``vision_config.patch_size``), with a
    ``head_dim`` (width over heads) where a sub-config states none."""
    top = config
    if isinstance(config.get("text_config"), dict) and "num_attention_heads" not in config:
        config = config["text_config"]
    if isinstance(config.get("model"), dict) and "n_heads" not in config:
        config = config["model"]
    hf = "num_attention_heads" in config or "hidden_size" in config
    n_heads = _int(config.get("num_attention_heads" if hf else "n_heads"))
    width = _int(config.get("hidden_size" if hf else "dim"))
    n_kv = _int(config.get("num_key_value_heads" if hf else "n_kv_heads")) or n_heads
    head_dim = _int(config.get("head_dim")) or (width // n_heads if width and n_heads else None)
    if head_dim is None:
        fields = "head_dim, or hidden_size and num_attention_heads" if hf else "head_dim, or dim and n_heads"
        raise UsageError(f"{source}: states neither {fields}; the preset needs the model's head_dim")
    if head_dim % 2:
        raise UsageError(f"{source}: head_dim {head_dim} is odd; rotary embeddings pair the dimensions of a head")
    layers = _int(config.get("num_hidden_layers" if hf else "n_layers"))
    experts = next((n for k in ("num_experts", "num_local_experts", "n_routed_experts") if (n := _int(config.get(k)))),
                   None)
    integers = tuple((k, v) for k, v in config.items() if _int(v) is not None)
    integers += tuple((f"{k}.{k2}", v2) for k, sub in top.items() if isinstance(sub, dict)  # vision_config.patch_size
                      for k2, v2 in {**_head_dim(sub), **sub}.items() if _int(v2) is not None)
    return ModelShape(head_dim, n_heads, n_kv, layers, tied, source, experts, integers)


def _head_dim(sub: dict) -> dict[str, int]:
    """A sub-config's head size where it states none: its width over its head count."""
    width, heads = _int(sub.get("hidden_size")), _int(sub.get("num_attention_heads") or sub.get("num_heads"))
    return {"head_dim": width // heads} if width and heads and width % heads == 0 else {}


def rotary_rows(n_rows: int, head_dim: int, to_hf: bool) -> tuple[int, ...]:
    """The row gather of the rotary transform (see the module docstring) for a q/k weight or bias of ``n_rows``
    rows: HF rows from interleaved ones when ``to_hf``, else the inverse."""
    half = head_dim // 2
    if to_hf:
        return tuple((r // head_dim) * head_dim + 2 * (r % head_dim % half) + r % head_dim // half
                     for r in range(n_rows))
    return tuple((s // head_dim) * head_dim + (s % head_dim % 2) * half + s % head_dim // 2 for s in range(n_rows))


TRANSFORMS = {"rotary": rotary_rows}
"""Named tensor transforms: each gives the row gather for (rows, head_dim, towards HF)."""


