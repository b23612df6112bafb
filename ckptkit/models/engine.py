"""A preset's table (:mod:`ckptkit.models.table`) applied to a model's tensors, as pure planning.

Call order: :func:`apply_preset` with the tensors (each with the key it came from), the preset, the model's
shape and the direction. It matches every key to a row (a key no row knows is refused, never passed through),
builds the other side's tensors from byte ranges (:mod:`ckptkit.core.reshape`: splits, joins, row gathers)
or as computed tensors (transposes, FP8 dequantization), and refuses a checkpoint that lacks a tensor of the
model, holds a variant of a layer in part, or disagrees with the config's counts. Nothing is read.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.dtypes import by_name
from ..core.manifest import TensorEntry
from ..core.reshape import dequantized, join_rows, split_rows, stack, take_rows, transposed, unstack
from ..errors import UsageError
from .names import RECOMPUTED
from .registry import PRESETS
from .table import STACK_FIELDS, TRANSFORMS, ModelShape, Preset, Row

__all__ = ["Adapted", "NameTable", "Source", "advice", "apply_preset", "listed", "nearest", "unknown_keys"]

_SHOWN = 8
_CONFIG_FIELDS = {"experts": "num_experts (or num_local_experts, n_routed_experts)", "layers": "num_hidden_layers"}
Binding = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Source:
    """A tensor to adapt, and the key the user knows it by (before any rename)."""

    origin: str
    entry: TensorEntry


@dataclass(frozen=True)
class Adapted:
    tensors: tuple[Source, ...]
    """The other side's tensors, each with the (first) key it was made from."""
    dropped: tuple[tuple[str, str], ...]
    notes: tuple[str, ...]
    gathered: int = 0
    """Tensors whose rows the rotary transform reordered."""


def listed(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _pattern(name: str) -> re.Pattern:
    text = re.escape(name)
    for ph in re.findall(r"\\\{(\w+)\\\}", text):
        text = text.replace(f"\\{{{ph}\\}}", f"(?P<{ph}>\\d+)", 1)
    return re.compile(text)


def _fill(name: str, binding: dict[str, str]) -> str:
    for k, v in binding.items():
        name = name.replace("{" + k + "}", v)
    return name


@dataclass(frozen=True)
class _Match:
    row: Row
    part: int
    binding: dict[str, str]


class NameTable:
    """A preset's rows as regular expressions, per side."""

    def __init__(self, p: Preset) -> None:
        self.hf = [(_pattern(n), r, i) for r in p.rows if not r.read_only for i, n in enumerate(r.hf_names)]
        self.other = [(_pattern(n), r, 0) for r in p.rows for n in r.other]
        self.dropped = [_pattern(d) for d in p.dropped]
        self.refused = [(_pattern(n), why) for n, why in p.refuse]

    @staticmethod
    def find(side: list, key: str) -> _Match | None:
        for regex, row, part in side:
            if m := regex.fullmatch(key):
                return _Match(row, part, m.groupdict())
        return None


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
    return True if to_hf else not only_hf


def apply_preset(sources: list[Source], p: Preset, shape: ModelShape | None, to_hf: bool | None) -> Adapted:
    """``sources`` under preset ``p``'s table, towards HF names (``to_hf``) or, when None, from whichever side
    the keys are named in to the other.

    Raises:
        UsageError: a key the table does not know; a tensor of the model missing; counts that disagree with
            the config (experts, heads, layers); the shape needed and not given.
    """
    table = NameTable(p)
    if p.needs_shape and shape is None:
        if all(r.plain for r in p.rows):
            raise UsageError(f"--preset {p.name} needs the model's head_dim for the rotary q/k row order: pass "
                             "--hf-assets DIR whose config.json states num_attention_heads and num_key_value_heads")
        fields = dict.fromkeys(_CONFIG_FIELDS.get(STACK_FIELDS.get(r.stacked, r.stacked), r.stacked)
                               for r in p.rows if r.stacked)
        fields.update(dict.fromkeys(r.groups for r in p.rows if r.groups))
        raise UsageError(f"--preset {p.name} needs config.json's {', '.join(f for f in fields if f)}: pass "
                         "--hf-assets DIR with the model's config.json")
    towards = True if p.identity else _direction(p, table, [s.entry.key for s in sources], to_hf)
    dropped: list[tuple[str, str]] = []
    if not towards and p.fp8:
        sources = _dequantize(sources, p)
    matched: list[tuple[Source, _Match]] = []
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
                         f"it knows: {listed(unknown)}; {advice(p, unknown, towards)}")
    build = _Builder(p, shape)
    out = build.to_hf(matched) if towards else build.from_hf(matched)
    canonical = {r.hf_names: r for r in p.rows if not r.read_only}
    present = {(canonical.get(m.row.hf_names, m.row), None if "n" in m.row.stack_axes else m.binding.get("n"))
               for _, m in matched}
    tied = _check_complete(p, present, shape, towards, {s.entry.key: s for s, _ in matched})
    out += tied
    notes = _notes(p, out, shape, towards, build.gathered)
    notes += tuple(f"{t.entry.key} written from {t.origin}: {shape.source if shape else 'the config'} ties them, "
                   f"and {p.other_side} keeps both" for t in tied)
    return Adapted(tuple(out), tuple(dropped), notes, build.gathered)


def unknown_keys(p: Preset, keys: Sequence[str], hf: bool = False) -> list[str]:
    """The keys that are none of ``p``'s names (its HF side when ``hf``) nor a buffer it leaves out."""
    table = NameTable(p)
    side = table.hf if hf else table.other
    return [k for k in keys if not (table.find(side, k) or any(d.fullmatch(k) for d in table.dropped))]


def nearest(keys: Sequence[str], presets: Sequence[Preset], hf: bool = False) -> tuple[Preset, list[str]]:
    """The preset of ``presets`` whose table knows the most of ``keys`` (the first on a tie), and the keys it
    does not know."""
    return min(((p, unknown_keys(p, keys, hf)) for p in presets), key=lambda s: len(s[1]))


def advice(p: Preset, unknown: Sequence[str], towards: bool) -> str:
    """What to do about keys that preset ``p``'s table does not know. Only what a consumer rebuilds itself
    (:data:`ckptkit.models.names.RECOMPUTED`) may be left out: leaving out a weight gives a model that loads
    with that weight initialised afresh."""
    weights = [k for k in unknown if not RECOMPUTED.search(k)]
    if not weights:
        shown = ", ".join(f'"{k}": null' for k in unknown[:_SHOWN])
        return (f"they are not weights (the model recomputes them): leave them out with --key-map '{{{shown}}}'"
                + (f" (and the {len(unknown) - _SHOWN} others)" if len(unknown) > _SHOWN else ""))
    kin = [q for q in PRESETS.values() if q.other_side == p.other_side and not q.identity] or [p]
    near, missing = nearest(weights, kin, hf=not towards)
    closest = ("no other preset knows more of them" if near is p else f"--preset {near.name} knows them"
               if not missing else f"the nearest, --preset {near.name}, does not know {len(missing)} of them")
    return (f"{listed(weights)} {'is a weight' if len(weights) == 1 else 'are weights'} of a family or variant "
            f"that --preset {p.name} does not map yet ({closest}); --preset none writes the names as they are")


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
        n = len(row.hf_names)
        if row.split is None:
            groups = self._groups(row, key)
            if total % (n * groups):
                raise UsageError(f"--preset {self.p.name}: {key!r} has {total} rows, not {n * groups} equal parts")
            return [total // (n * groups)] * n
        return [self._shape().count(c, f"splitting {key!r}") for c in row.split]

    def _groups(self, row: Row, key: str) -> int:
        return self._shape().value(row.groups, f"splitting {key!r}") if row.groups else 1

    def _gather(self, row: Row, entry: TensorEntry, to_hf: bool) -> TensorEntry:
        if not row.transform or self.p.identity:
            return entry
        shape = self._shape()
        order = TRANSFORMS[row.transform](entry.shape[0], shape.head_dim, to_hf)
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

    def to_hf(self, matched: list[tuple[Source, _Match]]) -> list[Source]:
        out: list[Source] = []
        for s, m in matched:
            row, entry = m.row, s.entry
            pieces = self._unstacked(row, m.binding, entry)
            for binding, piece in pieces:
                names = [_fill(n, binding) for n in row.hf_names]
                if len(names) == 1:
                    self._check_heads(row, piece)
                if row.transpose:  # after the unstacking: a computed tensor is not cut into byte ranges
                    piece = transposed(piece, piece.key)
                parts = self._split(row, piece, names) if len(names) > 1 else [_renamed(piece, names[0])]
                out += [Source(s.origin, self._gather(row, part, True)) for part in parts]
        return out

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

    def from_hf(self, matched: list[tuple[Source, _Match]]) -> list[Source]:
        """Gathers each row's HF tensors (its parts, its stacked indices) and builds the other side's tensor."""
        groups: dict[tuple[Row, Binding], dict[tuple[str, int], Source]] = {}
        for s, m in matched:
            axes = m.row.stack_axes
            rest = tuple(sorted((k, v) for k, v in m.binding.items() if k not in axes))
            index = ",".join(m.binding.get(a, "") for a in axes)
            groups.setdefault((m.row, rest), {})[(index, m.part)] = s
        return [self._joined(row, dict(rest), found) for (row, rest), found in groups.items()]

    def _joined(self, row: Row, binding: dict[str, str], found: dict[tuple[str, int], Source]) -> Source:
        name = _fill(row.other[0], binding)
        axes = row.stack_axes
        counts = [self._stack_count(a, name) for a in axes]
        indices = [",".join(map(str, i)) for i in itertools.product(*map(range, counts))]
        extra = sorted({i for i, _ in found} - set(indices))
        if extra:
            raise UsageError(f"--preset {self.p.name}: {name!r}: the checkpoint holds {'/'.join(axes)} "
                             f"{', '.join(extra)}, but {self._shape().source} gives "
                             f"{' x '.join(map(str, counts))} {'/'.join(STACK_FIELDS.get(a, a) for a in axes)}")
        missing = [_fill(n, {**binding, **dict(zip(axes, i.split(","), strict=True))} if axes else binding)
                   for i in indices for p, n in enumerate(row.hf_names) if (i, p) not in found]
        if missing:
            raise UsageError(f"--preset {self.p.name}: {name!r} is made of {len(indices) * len(row.hf_names)} "
                             f"tensors; the checkpoint lacks {listed(missing)}")
        stacked = []
        for i in indices:
            parts = [found[(i, p)].entry for p in range(len(row.hf_names))]
            for part in parts if len(parts) == 1 else ():
                self._check_heads(row, part)
            parts = [self._gather(row, part, False) for part in parts]
            stacked.append(self._fused(row, parts, name) if len(parts) > 1 else parts[0])
        if row.transpose:  # before the stacking: a computed tensor is not joined by byte ranges
            stacked = [transposed(e, name) for e in stacked]
            if row.stacked:
                raise UsageError(f"--preset {self.p.name}: {name!r}: a transposed row is not stacked on import")
        entry = _stack_nested(name, stacked, counts) if row.stacked else stacked[0]
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


def _check_complete(p: Preset, present: set[tuple[Row, str | None]], shape: ModelShape | None, towards: bool,
                    by_key: dict[str, Source]) -> list[Source]:
    """Refuses tensors of the table that the checkpoint lacks, layer by layer (a layer holds one variant of
    each slot, whole); returns the tied tensors written from what they are tied to (HF names -> the other's,
    which has no ties)."""
    layers = shape.layers if shape is not None and shape.layers else None
    seen = {int(n) for _, n in present if n is not None}
    if layers is not None and seen and max(seen) >= layers:
        raise UsageError(f"--preset {p.name}: {shape.source if shape else 'the config'} gives {layers} layers, but "
                         f"the checkpoint has layer {max(seen)}")
    numbers = [str(i) for i in range(layers if layers else (max(seen) + 1 if seen else 0))]
    missing: list[str] = []
    added: list[Source] = []
    for n in [None, *numbers]:
        rows = [r for r in p.rows
                if not r.read_only and ("n" in r.placeholders() and "n" not in r.stack_axes) == (n is not None)]
        variants: dict[str, set[str]] = {}
        for r in rows:
            if r.group and (r, n) in present:
                slot, _, variant = r.group.partition(":")
                variants.setdefault(slot, set()).add(variant)
        for slot, held in variants.items():
            if len(held) > 1:
                raise UsageError(f"--preset {p.name}: layer {n} holds both {' and '.join(sorted(held))} {slot} tensors")
        for r in rows:
            if (r, n) in present:
                continue
            if r.group:
                slot, _, variant = r.group.partition(":")
                chosen = variants.get(slot)
                if chosen is None and _first_variant(rows, slot) != variant or chosen and variant not in chosen:
                    continue
            binding = {"n": n} if n is not None else {}
            name = _fill(r.other[0] if towards else r.hf_names[0], binding)
            if r.tied_to and (shape is None or shape.tied is not False):
                tied = by_key.get(r.tied_to)
                if not towards and shape is not None and shape.tied and tied is not None:
                    new = _fill(r.other[0], binding)
                    added.append(Source(tied.origin, _renamed(tied.entry, new)))
                continue
            missing.append(name)
    if missing:
        raise UsageError(f"--preset {p.name}: the checkpoint lacks {len(missing)} keys of the model"
                         f"{f' ({layers} layers, from {shape.source})' if layers and shape else ''}: "
                         f"{listed(missing)}")
    return added


def _first_variant(rows: list[Row], slot: str) -> str:
    return next(r.group.partition(":")[2] for r in rows if r.group and r.group.partition(":")[0] == slot)
