"""Key mapping: the model's keys turned into another code base's names, as pure planning.

A :class:`KeyMapping` says how: ``key_map`` (exact names, from ``--key-map FILE.json``; ``null`` leaves a key
out), then ``renames`` (``--rename 'REGEX=REPLACEMENT'``, in order, each a :func:`re.sub` over every key),
then a ``preset`` (:mod:`.presets`: a name table with tensor transforms). :func:`map_keys` applies it to the
tensors that the model-part rule (:mod:`.select`) chose and named: it renames entries and attaches row
gathers, and reads no file, so a mapping streams like any conversion and ``--dry-run`` shows it whole.

Two keys that would get one name are an error naming both. Under ``strict``, so are keys that nothing
mapped; a preset is always strict, since a name it does not know would reach the consumer unmapped, and
it refuses keys missing from its table too.

The reader of the ``--key-map`` file (:func:`read_key_map`) is the only I/O here.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.manifest import TensorEntry
from ..errors import UsageError
from .presets import TRANSFORMS, ModelShape, Preset, Row, preset as preset_named

__all__ = ["KeyMapSource", "KeyMapping", "MappedKeys", "Renames", "key_mapping", "map_keys", "parse_rename",
           "read_json", "read_key_map", "rename_keys"]

Renames = Iterable[str | tuple[str, str]]
"""``--rename`` values: ``'REGEX=REPLACEMENT'`` strings, or (regex, replacement) pairs."""
KeyMapSource = Mapping[str, str | None] | Path | str | None
"""``--key-map``: old key to new key (None leaves it out), or the path of a JSON file of that."""
_SHOWN = 8
_MAX_OPTION_FILE = 64 << 20


@dataclass(frozen=True, kw_only=True)
class KeyMapping:
    """How to rename a model's keys, applied in this order: ``key_map``, ``renames``, ``preset``."""

    key_map: tuple[tuple[str, str | None], ...] = ()
    """Exact key to new key; None leaves the key out."""
    renames: tuple[tuple[str, str], ...] = ()
    """(regular expression, replacement) pairs, applied in order with :func:`re.sub` to every key."""
    preset: str | None = None
    """A name in :data:`ckptkit.ops.presets.PRESETS`."""
    strict: bool = False
    """Keys that neither the key map names nor a rename matches are an error (a preset always is strict)."""

    def __post_init__(self) -> None:
        for pattern, _ in self.renames:
            try:
                re.compile(pattern)
            except re.error as e:
                raise UsageError(f"--rename {pattern!r}: not a regular expression ({e})") from None
        if self.preset is not None:
            preset_named(self.preset)

    def __bool__(self) -> bool:
        return bool(self.key_map or self.renames or self.preset)


@dataclass(frozen=True)
class MappedKeys:
    """The tensors under their new names, and what the mapping did, for the report."""

    tensors: tuple[TensorEntry, ...]
    renamed: tuple[tuple[str, str], ...]
    """(old key, new key) for each key whose name changed."""
    dropped: tuple[tuple[str, str], ...]
    """(old key, why) for each key left out."""
    notes: tuple[str, ...]
    permuted: tuple[str, ...] = ()
    """New keys whose rows a preset's transform reordered."""


def parse_rename(text: str) -> tuple[str, str]:
    """``'REGEX=REPLACEMENT'`` split at the first ``=`` that is not part of the expression (``\\=``, ``(?=``,
    ``(?<=``, ``(?!=``, ``(?P=``)."""
    for i, c in enumerate(text):
        if c == "=" and (i == 0 or text[i - 1] not in "\\?<!P"):
            return text[:i], text[i + 1:]
    raise UsageError(f"--rename {text!r}: expected REGEX=REPLACEMENT, e.g. '^model\\.=' or 'attn\\.(\\w)_proj=\\1'")


def read_key_map(path: Path) -> tuple[tuple[str, str | None], ...]:
    """A ``--key-map`` file: a JSON object of old key to new key (``null``: leave the key out)."""
    data = read_json(path, "--key-map")
    if not isinstance(data, dict) or not all(isinstance(v, str) or v is None for v in data.values()):
        raise UsageError(f"--key-map {path}: expected a JSON object of old key to new key (or null to leave it out)")
    return tuple(data.items())


def key_mapping(*, preset: str | None = None, renames: Renames = (), key_map: KeyMapSource = None,
                strict: bool = False) -> KeyMapping:
    """A :class:`KeyMapping` from the library's and the CLI's arguments: ``renames`` as ``'REGEX=REPLACEMENT'``
    strings or pairs, ``key_map`` as a dict or the path of its JSON file."""
    pairs = tuple(parse_rename(r) if isinstance(r, str) else (r[0], r[1]) for r in renames)
    table = read_key_map(Path(key_map)) if isinstance(key_map, (str, Path)) else tuple((key_map or {}).items())
    return KeyMapping(key_map=table, renames=pairs, preset=preset, strict=strict)


def read_json(path: Path, what: str):
    """A small JSON file named by an option (``what``), as untrusted input."""
    try:
        if path.stat().st_size > _MAX_OPTION_FILE:
            raise UsageError(f"{what} {path}: {path.stat().st_size} bytes is too large for a JSON file of names")
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{what} {path}: cannot read it as JSON ({e})") from e


def _listed(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


@dataclass
class _Item:
    origin: str
    entry: TensorEntry


def _rename(item: _Item, key: str) -> None:
    item.entry = dataclasses.replace(item.entry, key=key, path=(key,))


def rename_keys(keys: Sequence[str], mapping: KeyMapping) -> tuple[dict[str, str | None], tuple[str, ...]]:
    """The key map and the renames of ``mapping`` (not its preset) applied to ``keys``: each key's new name (None:
    left out by the key map), and notes. Raises :class:`UsageError` on a collision, and under ``strict`` on keys
    that neither names."""
    names: dict[str, str | None] = dict.fromkeys(keys)
    current = {k: k for k in keys}
    touched: set[str] = set()
    notes: list[str] = []
    if mapping.key_map:
        table = dict(mapping.key_map)
        named = [k for k in keys if k in table]
        unused = [k for k in table if k not in names]
        if unused and mapping.strict:
            raise UsageError(f"--key-map names keys the model does not have: {_listed(unused)}")
        notes.append(f"--key-map: {len(named)} keys mapped" + (f"; {len(unused)} of its names not in the model "
                                                               f"({_listed(unused)})" if unused else ""))
        for k in named:
            touched.add(k)
            if table[k] is None:
                del current[k]
            else:
                current[k] = table[k] or ""
    for pattern, replacement in mapping.renames:
        regex, hits = re.compile(pattern), 0
        for k, now in current.items():
            if regex.search(now):
                try:
                    current[k] = regex.sub(replacement, now)
                except (re.error, IndexError) as e:
                    raise UsageError(f"--rename '{pattern}={replacement}': bad replacement ({e})") from None
                touched.add(k)
                hits += 1
        notes.append(f"--rename '{pattern}={replacement}' matched {hits} keys")
    if mapping.strict:
        unmapped = [k for k in keys if k not in touched]
        if unmapped:
            raise UsageError(f"--strict-map: {len(unmapped)} keys left unmapped: {_listed(unmapped)}")
    _check_collisions(current)
    names.update(current)
    return names, tuple(notes)


def _check_collisions(new_of: dict[str, str]) -> None:
    origins: dict[str, str] = {}
    for old, new in new_of.items():
        if not new:
            raise UsageError(f"key {old!r} would be renamed to an empty name")
        if new in origins:
            raise UsageError(f"keys {origins[new]!r} and {old!r} would both be named {new!r}")
        origins[new] = old


def map_keys(tensors: Iterable[TensorEntry], mapping: KeyMapping, *, shape: ModelShape | None = None,
             to_hf: bool | None = None) -> MappedKeys:
    """``tensors`` renamed by ``mapping``. ``shape`` gives a preset its head counts (required by a preset with a
    transform); ``to_hf`` says which way a preset maps: towards HF names (True), or, when None, from whichever
    side the keys are named in to the other.

    Raises :class:`UsageError` on collisions, on unmapped keys under ``strict``, and on keys a preset does
    not know or misses.
    """
    tensors = list(tensors)
    names, said = rename_keys([t.key for t in tensors], mapping)
    notes = list(said)
    dropped = [(t.key, "--key-map") for t in tensors if names[t.key] is None]
    items = [_Item(t.key, t) for t in tensors if names[t.key] is not None]
    for item in items:
        if names[item.origin] != item.origin:
            _rename(item, names[item.origin] or "")
    if mapping.preset is not None:
        items, dropped_here, notes_here = _apply_preset(items, preset_named(mapping.preset), shape, to_hf)
        dropped += dropped_here
        notes += notes_here
    _check_collisions({i.origin: i.entry.key for i in items})
    original = {t.key: t.rows for t in tensors}
    renamed = tuple((i.origin, i.entry.key) for i in items if i.origin != i.entry.key)
    permuted = tuple(i.entry.key for i in items if i.entry.rows is not None and i.entry.rows != original.get(i.origin))
    return MappedKeys(tuple(i.entry for i in items), renamed, tuple(dropped), tuple(notes), permuted)


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(name).replace(re.escape("{n}"), r"(?P<n>\d+)"))


@dataclass(frozen=True)
class _Table:
    """A preset's rows as regular expressions, per side."""

    hf: tuple[tuple[re.Pattern, Row], ...]
    other: tuple[tuple[re.Pattern, Row], ...]
    dropped: tuple[re.Pattern, ...]

    @classmethod
    def of(cls, p: Preset) -> _Table:
        return cls(tuple((_pattern(r.hf), r) for r in p.rows),
                   tuple((_pattern(name), r) for r in p.rows for name in r.other),
                   tuple(_pattern(d) for d in p.dropped))

    @staticmethod
    def find(side: tuple[tuple[re.Pattern, Row], ...], key: str) -> tuple[Row, str | None] | None:
        for regex, row in side:
            if m := regex.fullmatch(key):
                return row, m.groupdict().get("n")
        return None


def _direction(p: Preset, table: _Table, keys: list[str], to_hf: bool | None) -> bool:
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


def _apply_preset(items: list[_Item], p: Preset, shape: ModelShape | None,
                  to_hf: bool | None) -> tuple[list[_Item], list[tuple[str, str]], list[str]]:
    table = _Table.of(p)
    if p.needs_shape and shape is None:
        raise UsageError(f"--preset {p.name} needs the model's head_dim for the rotary q/k row order: pass "
                         "--hf-assets DIR whose config.json states num_attention_heads and num_key_value_heads")
    towards = True if p.identity else _direction(p, table, [i.entry.key for i in items], to_hf)
    source, target = (table.other, "hf") if towards else (table.hf, "other")
    kept: list[_Item] = []
    dropped: list[tuple[str, str]] = []
    unknown: list[str] = []
    present: dict[tuple[Row, str | None], _Item] = {}
    gathered = 0
    for item in items:
        key = item.entry.key
        found = table.find(source, key)
        if found is None:
            if any(d.fullmatch(key) for d in table.dropped):
                dropped.append((item.origin, f"not a weight ({p.name})"))
            else:
                unknown.append(key)
            continue
        row, n = found
        present[(row, n)] = item
        _check_rows(p, row, item.entry, shape)
        name = row.hf if target == "hf" else row.other[0]
        _rename(item, name.replace("{n}", n or ""))
        if row.transform and not p.identity and shape is not None:  # a transform needs the shape: checked above
            order = TRANSFORMS[row.transform](item.entry.shape[0], shape.head_dim, towards)
            old = item.entry.rows
            item.entry = dataclasses.replace(item.entry, rows=order if old is None else tuple(old[r] for r in order))
            gathered += 1
        kept.append(item)
    if unknown:
        raise UsageError(f"--preset {p.name}: {len(unknown)} keys are not {p.other_side if towards else 'HF'} names "
                         f"it knows: {_listed(unknown)}; rename them first (--rename, --key-map) or leave them out "
                         "with --key-map '{\"KEY\": null}'")
    added = _missing(p, present, shape, towards)
    kept += added
    notes = []
    if not p.identity:
        ways = f"{p.other_side} names -> HF names" if towards else f"HF names -> {p.other_side} names"
        notes.append(f"--preset {p.name}: {len(kept)} keys mapped, {ways}")
    else:
        notes.append(f"--preset {p.name}: {len(kept)} keys checked against its table")
    if added:
        notes.append(f"{added[0].entry.key} written from {added[0].origin}: {shape.source if shape else 'the config'} "
                     f"ties them, and {p.other_side} keeps both")
    if gathered and shape is not None:
        source_side, target_side = (p.other_side, "HF") if towards else ("HF", p.other_side)
        notes.append(f"q/k rows of {gathered} tensors reordered from {source_side}'s rotary layout to "
                     f"{target_side}'s (head_dim {shape.head_dim}, from {shape.source})")
    return kept, dropped, notes


def _check_rows(p: Preset, row: Row, entry: TensorEntry, shape: ModelShape | None) -> None:
    """A q/k/v tensor holds ``heads × head_dim`` rows, as the config says; a transform needs whole heads."""
    if shape is None or row.heads is None:
        return
    rows = entry.shape[0] if entry.shape else 0
    heads = shape.heads(row.heads)
    if heads is not None and rows != heads * shape.head_dim:
        field = "num_attention_heads" if row.heads == "n_heads" else "num_key_value_heads"
        raise UsageError(f"--preset {p.name}: {entry.key!r} has {rows} rows, but {shape.source} gives {field} "
                         f"{heads} x head_dim {shape.head_dim} = {heads * shape.head_dim}")
    if row.transform and rows % shape.head_dim:
        raise UsageError(f"--preset {p.name}: {entry.key!r} has {rows} rows, not whole heads of head_dim "
                         f"{shape.head_dim} ({shape.source})")


def _missing(p: Preset, present: dict[tuple[Row, str | None], _Item], shape: ModelShape | None,
             towards: bool) -> list[_Item]:
    """Refuses keys of the table the checkpoint lacks; returns the tied tensors written from what they are tied
    to (HF names -> the other's, which has no ties)."""
    layers = shape.layers if shape is not None and shape.layers else None
    seen = {int(n) for _, n in present if n is not None}
    numbers = [str(i) for i in range(layers if layers else (max(seen) + 1 if seen else 0))]
    if layers is not None and seen and max(seen) >= layers:
        extra = sorted(item.origin for (_, n), item in present.items() if n is not None and int(n) >= layers)
        raise UsageError(f"--preset {p.name}: {shape.source if shape else 'the config'} gives {layers} layers, but the "
                         f"checkpoint has more: {_listed(extra)}")
    missing: list[str] = []
    added: list[_Item] = []
    by_hf = {row.hf: item for (row, n), item in present.items() if n is None}
    for row in p.rows:
        for n in (numbers if "{n}" in row.hf else [None]):
            if (row, n) in present:
                continue
            name = (row.other[0] if towards else row.hf).replace("{n}", n or "")
            tied = shape.tied if shape is not None else None
            if row.tied_to and tied is not False:
                if not towards and tied and row.tied_to in by_hf:
                    origin = by_hf[row.tied_to]
                    new = row.other[0].replace("{n}", n or "")
                    added.append(_Item(origin.origin, dataclasses.replace(origin.entry, key=new, path=(new,))))
                continue
            missing.append(name)
    if missing:
        raise UsageError(f"--preset {p.name}: the checkpoint lacks {len(missing)} keys of the model"
                         f"{f' ({layers} layers, from {shape.source})' if layers and shape else ''}: "
                         f"{_listed(missing)}")
    return added
