"""A preset's table (:mod:`ckptkit.models.preset`) applied to a model's tensors, as pure planning.

Call order: :func:`apply_preset` with the tensors (each with the key it came from), the preset, the model's
shape and the direction. It matches every key to a row (a key no row knows is refused, never passed through),
builds the other side's tensors from byte ranges (:mod:`ckptkit.core.reshape`: splits, joins, row gathers)
or as computed tensors (transposes, interleaves, FP8 dequantization), and refuses a checkpoint that lacks a
tensor of the model, holds a variant of a layer in part, or disagrees with the config's counts. Nothing is read.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.dtypes import by_name
from ..core.manifest import TensorEntry
from ..core.reshape import (
    dequantized,
    dequantized_mxfp4,
    interleaved,
    join_along,
    join_rows,
    reshaped,
    split_along,
    split_rows,
    stack,
    take_rows,
    transposed,
    unstack,
)
from ..errors import UsageError
from .completeness import Source, buffers, check_complete, fill, listed
from .matching import Match, NameTable, advice
from .preset import STACK_FIELDS, TRANSFORMS, Preset, Row
from .shape import CONFIG_NAMES, ModelShape

__all__ = ["Adapted", "apply_preset"]
Binding = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Adapted:
    tensors: tuple[Source, ...]
    """The other side's tensors, each with the (first) key it was made from."""
    dropped: tuple[tuple[str, str], ...]
    notes: tuple[str, ...]
    gathered: int = 0
    """Tensors whose rows the rotary transform reordered."""


def _direction(p: Preset, table: NameTable, keys: list[str], to_hf: bool | None) -> bool:
    """True to map towards HF names, False from them, as the keys are named."""
    hf = {k for k in keys if table.find(table.hf, k)}
    other = {k for k in keys if table.find(table.other, k)}
    only_hf, only_other = sorted(hf - other), sorted(other - hf)
    if to_hf and only_hf and not only_other:
        raise UsageError(f"--preset {p.name}: the keys are Hugging Face names already (e.g. {only_hf[0]!r}); "
                         f"the preset maps {p.other_side} names to them")
    if only_hf and only_other and not to_hf:
        raise UsageError(f"--preset {p.name}: the keys mix Hugging Face names ({only_hf[0]!r}) and "
                         f"{p.other_side} names ({only_other[0]!r})")
    if to_hf is False and only_other and not only_hf:  # asked for the other side's names, and they are already
        raise UsageError(f"--preset {p.name}: the keys are {p.other_side} names already (e.g. {only_other[0]!r}); "
                         f"this conversion maps Hugging Face names to them (reshard re-lays a checkpoint as it is)")
    return True if to_hf else not only_hf


def _spelling(p: Preset, table: NameTable, keys: list[str], to_hf: bool | None) -> Preset:
    """``p`` in the spelling of layer-stacked tensors that ``keys`` use (:meth:`Preset.per_layer`), or, from HF
    names, that megatron-core writes for the model: per layer where the layers hold different variants of a
    slot (dense and MoE)."""
    if p.layer_prefix is None:
        return p
    spellings = [p, p.per_layer(), p.per_layer(singletons=True)]
    tables = [table, *map(NameTable, spellings[1:])]
    own = [[k for k in keys if t.find(t.other, k) and not any(u.find(u.other, k) for u in tables if u is not t)]
           for t in tables]
    used = [i for i, found in enumerate(own) if found]
    if len(used) > 1:
        raise UsageError(f"--preset {p.name}: the keys mix two spellings of {p.other_side}'s layers: "
                         f"{own[used[0]][0]!r} and {own[used[1]][0]!r}")
    if used:
        return spellings[used[0]]
    if to_hf:
        return p
    variants: dict[str, set[str]] = {}
    for k in keys:
        m = table.find(table.hf, k)
        if m is not None and m.row.group:
            slot, _, variant = m.row.group.partition(":")
            variants.setdefault(slot, set()).add(variant)
    return spellings[1] if any(len(v) > 1 for v in variants.values()) else p


def apply_preset(sources: list[Source], p: Preset, shape: ModelShape | None, to_hf: bool | None,
                 kin: Sequence[Preset] = ()) -> Adapted:
    """``sources`` under preset ``p``'s table, towards HF names (``to_hf``) or, when None, from whichever side
    the keys are named in to the other; ``kin``: the presets a refusal's advice may name (``p``'s framework's).

    Raises:
        UsageError: a key the table does not know; a tensor of the model missing; counts that disagree with
            the config (experts, heads, layers); the shape needed and not given.
    """
    _require_shape(p, shape)
    table = NameTable(p)
    keys = [s.entry.key for s in sources]
    spelled = _spelling(p, table, keys, to_hf)
    if spelled is not p:  # megatron-core's other spelling of the layers: its own table
        p, table = spelled, NameTable(spelled)
    towards = True if p.identity else _direction(p, table, keys, to_hf)
    dropped: list[tuple[str, str]] = []
    if not towards and p.fp8:
        sources = _dequantize(sources, p)
    if not towards and p.mxfp4:
        sources = _dequantize_mxfp4(sources, p)
    matched: list[tuple[Source, Match]] = []
    unknown: list[str] = []
    for s in sources:
        key = s.entry.key
        for regex, why in table.refused:
            if regex.fullmatch(key):
                raise UsageError(f"--preset {p.name}: {key!r}: {why}")
        found = table.find(table.other if towards else table.hf, key)
        if found is not None:
            matched.append((s, found))
        elif any(d.fullmatch(key) for d in table.dropped):
            dropped.append((s.origin, f"not a weight ({p.name})"))
        else:
            unknown.append(key)
    if unknown:
        raise UsageError(f"--preset {p.name}: {len(unknown)} keys are not {p.other_side if towards else 'HF'} names "
                         f"it knows: {listed(unknown)}; {advice(p, unknown, towards, kin)}")
    build = _Builder(p, shape)
    out = build.to_hf(matched) if towards else build.from_hf(matched)
    canonical = {r.hf_names: r for r in p.rows if not r.read_only}
    present = {(canonical.get(m.row.hf_names, m.row), None if "n" in m.row.stack_axes else m.binding.get("n"))
               for _, m in matched}
    tied = check_complete(p, present, shape, towards, {s.entry.key: s for s, _ in matched})
    filled = [] if towards else buffers(p, present, shape)
    out += tied + filled
    notes = _notes(p, out, shape, towards, build.gathered)
    notes += tuple(f"{t.entry.key} written from {t.origin}: {shape.source if shape else 'the config'} ties them, "
                   f"and {p.other_side} keeps both" for t in tied)
    if filled:
        notes += (f"{len(filled)} buffers that {p.other_side}'s model holds and HF has no tensor for written at "
                  f"their initial value ({', '.join(sorted({b.init for b in p.buffers}))}): "
                  f"{listed([f.entry.key for f in filled])}",)
    return Adapted(tuple(out), tuple(dropped), notes, build.gathered)


def _require_shape(p: Preset, shape: ModelShape | None) -> None:
    """Refuses a preset that needs the model's shape, given none, naming the config fields it needs."""
    if p.needs_shape and shape is None:
        if all(r.plain for r in p.rows):
            raise UsageError(f"--preset {p.name} needs the model's head_dim for the rotary q/k row order: pass "
                             "--hf-assets DIR whose config.json states num_attention_heads and num_key_value_heads")
        needed = [STACK_FIELDS.get(a, a) for r in p.rows for a in r.stack_axes] + [r.groups for r in p.rows if r.groups]
        fields = dict.fromkeys(CONFIG_NAMES.get(f, f) for f in needed if f)
        raise UsageError(f"--preset {p.name} needs config.json's {', '.join(f for f in fields if f)}: pass "
                         "--hf-assets DIR with the model's config.json")


def _notes(p: Preset, out: list[Source], shape: ModelShape | None, towards: bool, gathered: int) -> tuple[str, ...]:
    if p.identity:
        return (f"--preset {p.name}: {len(out)} keys checked against its table",)
    ways = f"{p.other_side} names -> HF names" if towards else f"HF names -> {p.other_side} names"
    notes = [f"--preset {p.name}: {len(out)} keys mapped, {ways}"]
    if gathered and shape is not None:
        a, b = (p.other_side, "HF") if towards else ("HF", p.other_side)
        notes.append(f"q/k rows of {gathered} tensors reordered from {a}'s rotary layout to {b}'s "
                     f"(head_dim {shape.head_dim}, from {shape.source})")
    return tuple(notes)


def _dequantize(sources: list[Source], p: Preset) -> list[Source]:
    """Each float8 ``X.weight`` with its ``X.weight_scale_inv`` as one float32 tensor computed from both."""
    by_key = {s.entry.key: s for s in sources}
    scales = {k for k in by_key if k.endswith(".weight_scale_inv")}
    out: list[Source] = []
    for s in sources:
        key, entry = s.entry.key, s.entry
        if key in scales:
            if key.removesuffix("_scale_inv") not in by_key:
                raise UsageError(f"--preset {p.name}: {key!r} scales no weight: "
                                 f"{key.removesuffix('_scale_inv')!r} is missing")
            continue
        if entry.dtype.name.startswith("float8"):
            scale = by_key.get(key + "_scale_inv")
            if scale is None:
                raise UsageError(f"--preset {p.name}: {key!r} is {entry.dtype} but {key + '_scale_inv'!r} is "
                                 "missing; an FP8 weight is read with its block scales")
            entry = dequantized(entry, scale.entry, key, by_name("float32"))
        out.append(Source(s.origin, entry))
    return out


def _dequantize_mxfp4(sources: list[Source], p: Preset) -> list[Source]:
    """Each MXFP4 ``X_blocks`` with its ``X_scales`` as one bf16 ``X`` in HF's layout: the dequantized blocks'
    last two dims swapped, as transformers' ``convert_moe_packed_tensors`` returns them."""
    by_key = {s.entry.key: s for s in sources}
    out: list[Source] = []
    for s in sources:
        key = s.entry.key
        if key.endswith("_scales") and key.removesuffix("_scales") + "_blocks" in by_key:
            continue
        if not key.endswith("_blocks"):
            out.append(s)
            continue
        name = key.removesuffix("_blocks")
        scales = by_key.get(name + "_scales")
        if scales is None:
            raise UsageError(f"--preset {p.name}: {key!r} holds MXFP4 blocks but {name + '_scales'!r} is missing; "
                             "MXFP4 blocks are read with their scales")
        values = dequantized_mxfp4(s.entry, scales.entry, name, by_name("bfloat16"))
        out.append(Source(s.origin, transposed(values, name)))
    return out


class _Builder:
    """Makes the other side's tensors for matched rows, and checks their counts against the shape."""

    def __init__(self, p: Preset, shape: ModelShape | None) -> None:
        self.p, self.shape, self.gathered = p, shape, 0

    def _shape(self) -> ModelShape:
        assert self.shape is not None  # apply_preset refuses a preset that needs one without it
        return self.shape

    def _stack_count(self, axis: str, entry_key: str) -> int:
        return self._shape().value(STACK_FIELDS.get(axis, axis), f"{entry_key!r} (stacked along a leading dim)")

    def _unstacked(self, row: Row, binding: dict[str, str], entry: TensorEntry) -> list[tuple[dict, TensorEntry]]:
        """``entry`` cut along each of the row's stacking dims, outermost first, with each piece's binding."""
        pieces = [(binding, entry)]
        for axis in row.stack_axes:
            count = self._stack_count(axis, entry.key)
            if len(entry.shape) < len(row.stack_axes) or entry.shape[row.stack_axes.index(axis)] != count:
                raise UsageError(f"--preset {self.p.name}: {entry.key!r} of shape {list(entry.shape)} stacks "
                                 f"{STACK_FIELDS.get(axis, axis)} along dim {row.stack_axes.index(axis)}, but "
                                 f"{self._shape().source} gives {count}")
            pieces = [({**b, axis: str(i)}, part) for b, e in pieces
                      for i, part in enumerate(unstack(e, [f"{e.key}[{i}]" for i in range(count)]))]
        return pieces

    def _part_rows(self, row: Row, total: int, key: str) -> list[int]:
        """Rows of each HF part in one group of a fused tensor of ``total`` rows."""
        n = len(row.other) if row.hf_fuses else len(row.hf_names)
        if row.split is None:
            groups = self._groups(row, key)
            if total % (n * groups):
                raise UsageError(f"--preset {self.p.name}: {key!r} has {total} rows, not {n * groups} equal parts")
            return [total // (n * groups)] * n
        return [self._shape().count(c, f"splitting {key!r}") for c in row.split]

    def _groups(self, row: Row, key: str) -> int:
        return self._shape().value(row.groups, f"splitting {key!r}") if row.groups else 1

    def _gather(self, row: Row, entry: TensorEntry, to_hf: bool, part: int = 0) -> TensorEntry:
        skipped = row.transform_parts is not None and part not in row.transform_parts  # a fused qkv's v
        if not row.transform or self.p.identity or skipped:
            return entry
        shape = self._shape()
        head_dim = shape.head_dim if row.head_dim is None else shape.value(row.head_dim, f"{entry.key!r}'s rotary rows")
        if entry.shape[0] % head_dim:
            raise UsageError(f"--preset {self.p.name}: {entry.key!r} has {entry.shape[0]} rows, not whole heads of "
                             f"{row.head_dim or 'head_dim'} {head_dim} ({shape.source})")
        order = TRANSFORMS[row.transform](entry.shape[0], head_dim, to_hf)
        old = entry.rows
        self.gathered += 1
        return dataclasses.replace(entry, rows=order if old is None else tuple(old[r] for r in order))

    def _check_heads(self, row: Row, entry: TensorEntry) -> None:
        """A q/k/v tensor holds ``heads × head_dim`` rows, as the config says; a transform needs whole heads."""
        shape = self.shape
        if shape is None or row.heads is None:
            return
        rows = entry.shape[0] if entry.shape else 0
        heads = shape.heads(row.heads)
        if heads is not None and rows != heads * shape.head_dim:
            field = "num_attention_heads" if row.heads == "n_heads" else "num_key_value_heads"
            raise UsageError(f"--preset {self.p.name}: {entry.key!r} has {rows} rows, but {shape.source} gives "
                             f"{field} {heads} x head_dim {shape.head_dim} = {heads * shape.head_dim}")
        if row.transform and rows % shape.head_dim:
            raise UsageError(f"--preset {self.p.name}: {entry.key!r} has {rows} rows, not whole heads of head_dim "
                             f"{shape.head_dim} ({shape.source})")

    def to_hf(self, matched: list[tuple[Source, Match]]) -> list[Source]:
        out: list[Source] = []
        fused: dict[tuple[Row, Binding], dict[int, Source]] = {}
        for s, m in matched:
            row, entry = m.row, s.entry
            if row.hf_fuses:
                fused.setdefault((row, tuple(sorted(m.binding.items()))), {})[m.part] = s
                continue
            if row.hf_dims:
                dims = tuple(self._shape().count(c, f"{entry.key!r}'s HF shape") for c in row.hf_dims)
                name = fill(row.hf_names[0], m.binding)
                out.append(Source(s.origin, reshaped(entry, name, dims)))
                continue
            pieces = self._unstacked(row, m.binding, entry)
            for binding, piece in pieces:
                names = [fill(n, binding) for n in row.hf_names]
                if len(names) == 1:
                    self._check_heads(row, piece)
                if row.transpose:  # after the unstacking: a computed tensor is not cut into byte ranges
                    piece = transposed(piece, piece.key)
                if row.interleave:
                    piece = interleaved(piece, piece.key)
                parts = self._split(row, piece, names) if len(names) > 1 else [_renamed(piece, names[0])]
                out += [Source(s.origin, self._gather(row, part, True, i)) for i, part in enumerate(parts)]
        return out + [self._fuse(row, dict(binding), parts) for (row, binding), parts in fused.items()]

    def _fuse(self, row: Row, binding: dict[str, str], found: dict[int, Source]) -> Source:
        """HF's tensor of a ``hf_fuses`` row from the other side's parts, one after another along its dim."""
        name = fill(row.hf_names[0], binding)
        missing = [fill(n, binding) for i, n in enumerate(row.other) if i not in found]
        if missing:
            raise UsageError(f"--preset {self.p.name}: {name!r} is made of {len(row.other)} tensors; the checkpoint "
                             f"lacks {listed(missing)}")
        parts = [found[i].entry for i in range(len(row.other))]
        sizes = [p.shape[row.fuse_dim] if len(p.shape) > row.fuse_dim else 0 for p in parts]
        if sizes != self._part_rows(row, sum(sizes), name):
            raise UsageError(f"--preset {self.p.name}: {name!r}: its parts have {sizes} along dim {row.fuse_dim}, "
                             f"but {self._shape().source} gives {self._part_rows(row, sum(sizes), name)}")
        return Source(found[0].origin, join_along(name, parts, row.fuse_dim))

    def _unfuse(self, row: Row, binding: dict[str, str], entry: TensorEntry) -> list[Source]:
        """The other side's parts of HF's tensor of a ``hf_fuses`` row."""
        names = [fill(n, binding) for n in row.other]
        total = entry.shape[row.fuse_dim] if len(entry.shape) > row.fuse_dim else 0
        counts = self._part_rows(row, total, entry.key)
        if sum(counts) != total:
            raise UsageError(f"--preset {self.p.name}: {entry.key!r} has {total} along dim {row.fuse_dim}, but its "
                             f"parts ({', '.join(names)}) take {' + '.join(map(str, counts))}")
        return [Source(entry.key, e) for e in split_along(entry, counts, names, row.fuse_dim)]

    def _split(self, row: Row, entry: TensorEntry, names: list[str]) -> list[TensorEntry]:
        counts = self._part_rows(row, entry.shape[0] if entry.shape else 0, entry.key)
        groups, per = self._groups(row, entry.key), sum(counts)
        if per * groups != (entry.shape[0] if entry.shape else 0):
            raise UsageError(f"--preset {self.p.name}: {entry.key!r} has {entry.shape[0] if entry.shape else 0} rows, "
                             f"but its parts ({', '.join(names)}) take {groups} x {per}")
        if groups == 1:
            return split_rows(entry, counts, names)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return [take_rows(name, [(entry, g * per + a, g * per + a + n) for g in range(groups)])
                for name, a, n in zip(names, starts, counts, strict=True)]

    def from_hf(self, matched: list[tuple[Source, Match]]) -> list[Source]:
        """Gathers each row's HF tensors (its parts, its stacked indices) and builds the other side's tensor."""
        groups: dict[tuple[Row, Binding], dict[tuple[str, int], Source]] = {}
        out: list[Source] = []
        for s, m in matched:
            if m.row.hf_fuses:
                out += [Source(s.origin, p.entry) for p in self._unfuse(m.row, m.binding, s.entry)]
                continue
            axes = m.row.stack_axes
            rest = tuple(sorted((k, v) for k, v in m.binding.items() if k not in axes))
            index = ",".join(m.binding.get(a, "") for a in axes)
            groups.setdefault((m.row, rest), {})[(index, m.part)] = s
        return out + [self._joined(row, dict(rest), found) for (row, rest), found in groups.items()]

    def _joined(self, row: Row, binding: dict[str, str], found: dict[tuple[str, int], Source]) -> Source:
        name = fill(row.other[0], binding)
        axes = row.stack_axes
        counts = [self._stack_count(a, name) for a in axes]
        indices = [",".join(map(str, i)) for i in itertools.product(*map(range, counts))]
        extra = sorted({i for i, _ in found} - set(indices))
        if extra:
            raise UsageError(f"--preset {self.p.name}: {name!r}: the checkpoint holds {'/'.join(axes)} "
                             f"{', '.join(extra)}, but {self._shape().source} gives "
                             f"{' x '.join(map(str, counts))} {'/'.join(STACK_FIELDS.get(a, a) for a in axes)}")
        missing = [fill(n, {**binding, **dict(zip(axes, i.split(","), strict=True))} if axes else binding)
                   for i in indices for p, n in enumerate(row.hf_names) if (i, p) not in found]
        if missing:
            raise UsageError(f"--preset {self.p.name}: {name!r} is made of {len(indices) * len(row.hf_names)} "
                             f"tensors; the checkpoint lacks {listed(missing)}")
        stacked = []
        for i in indices:
            parts = [found[(i, p)].entry for p in range(len(row.hf_names))]
            for part in parts if len(parts) == 1 else ():
                self._check_heads(row, part)
            parts = [self._gather(row, part, False, i) for i, part in enumerate(parts)]
            stacked.append(self._fused(row, parts, name) if len(parts) > 1 else parts[0])
        if row.interleave:
            stacked = [interleaved(e, name, inverse=True) for e in stacked]
        if row.transpose:  # before the stacking, which stacks computed tensors as one computed tensor
            stacked = [transposed(e, name) for e in stacked]
        entry = _stack_nested(name, stacked, counts) if row.stacked else stacked[0]
        if row.hf_dims:
            entry = reshaped(entry, name, (int(math.prod(entry.shape[1:])),))
        origin = found[(indices[0], 0)].origin
        return Source(origin, entry if not row.plain else _renamed(entry, name))

    def _fused(self, row: Row, parts: list[TensorEntry], name: str) -> TensorEntry:
        groups = self._groups(row, name)
        sizes = [p.shape[0] if p.shape else 0 for p in parts]
        if any(n % groups for n in sizes):
            raise UsageError(f"--preset {self.p.name}: {name!r}: parts of {sizes} rows do not split into {groups} "
                             "groups")
        if groups == 1:
            return join_rows(name, parts)
        per = [n // groups for n in sizes]
        return take_rows(name, [(p, g * n, (g + 1) * n) for g in range(groups)
                                for p, n in zip(parts, per, strict=True)])


def _stack_nested(name: str, entries: list[TensorEntry], counts: list[int]) -> TensorEntry:
    """``entries``, in row-major order of the index ``counts``, stacked along ``len(counts)`` leading dims."""
    if len(counts) == 1:
        return stack(name, entries)
    inner = len(entries) // counts[0]
    return stack(name, [_stack_nested(f"{name}[{i}]", entries[i * inner:(i + 1) * inner], counts[1:])
                        for i in range(counts[0])])


def _renamed(entry: TensorEntry, key: str) -> TensorEntry:
    return dataclasses.replace(entry, key=key, path=(key,))
