"""Presets: declarative tables of how another code base's tensors (torchtitan's, Meta's, Megatron's) become
Hugging Face's, and back.

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
  the other (an MoE's experts: gate and up columns interleaved in HF, gate rows then up rows in megatron-core's
  ``linear_fc1``); on the way to HF after any transpose, on the way back before it; computed box by box.
- ``hf_fuses``: the reverse of a tuple ``hf``: HF's one tensor is the other side's tensors, all of ``other``
  in order, one after another along dim ``fuse_dim`` (0; or 1 under a leading expert dim); ``split`` gives
  their sizes (None: equal). A vision tower's fused ``qkv``; a fused ``gate_up_proj`` ``[E, 2F, D]``.
- ``hf_dims``: HF's dims past the first, which the other side holds flattened into one (a convolution's
  kernel as a linear layer's row); each a row count as in ``split``. Moves no byte.
- ``group``: ``"slot:variant"``. A layer holds exactly one variant of each slot, and all of its rows:
  ``"mlp:dense"`` or ``"mlp:moe"`` (dense first layers, then MoE ones), ``"q:plain"`` or ``"q:lora"``. A
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
(128x128 blocks) into float32 before the table applies (what torchtitan's FP8 import reads through torch's
``QuantizedHuggingFaceStorageReader``). A preset with ``mxfp4`` dequantizes each ``X_blocks``
(uint8, two FP4 values a byte, 32 values a block) with its ``X_scales`` (e8m0) into bf16 ``X``, HF's layout of
the tensor (the transpose of the blocks' rows and values, as transformers' ``convert_moe_packed_tensors``
returns it; MXFP4 releases' experts).

The rotary transform. torchtitan's and Meta's original code rotate adjacent pairs ``(2i, 2i+1)``
of each q/k head as complex numbers; Hugging Face's ``rotate_half`` rotates ``(i, i + head_dim/2)``. So the
HF rows of a head are the other code base's rows in the order even, then odd. With ``hd = head_dim``,
``half = hd/2``, HF row ``r = h·hd + j`` is row ``h·hd + 2·(j mod half) + j // half`` of the other's, which
is what torchtitan's state dict adapter's ``_permute`` and transformers' conversion script's ``permute``
compute; the inverse, ``_reverse_permute``, takes HF row ``h·hd + (k mod 2)·half + k // 2`` to row ``h·hd + k``.
Only ``head_dim`` enters, so the same map serves q (``num_attention_heads`` heads) and k
(``num_key_value_heads``).

A family's module in :mod:`ckptkit.models.families` holds its presets, each naming the ``model_type`` values it
is detected by.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["STACK_FIELDS", "TRANSFORMS", "Buffer", "Count", "Heads", "Preset", "Row", "rotary_rows"]

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
    """(HF name pattern, why): keys refused with that reason (MXFP4 ``_blocks`` a table does not read)."""
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
    (:data:`ckptkit.models.megatron_args.ARGS`): linear biases, attention sinks, YaRN, a quick GeGLU."""

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


