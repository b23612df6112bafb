"""Key mapping: the model's keys turned into another code base's names, as pure planning.

A :class:`KeyMapping` says how, as one object: ``key_map`` (exact names, from ``--key-map``, inline JSON or a file;
``null`` leaves a key out), then ``renames`` (``--rename 'REGEX=REPLACEMENT'``, in order, each a :func:`re.sub` over
every key), then a ``preset`` (a family's table with tensor transforms, :mod:`ckptkit.models.preset`), with what
the preset reads beside the keys: ``hf_assets`` (a ``config.json``) and ``megatron_args``.
:func:`ckptkit.models.resolve.resolve` makes it concrete for one checkpoint, and :func:`map_keys` applies it to the
tensors that the model-part rule (:mod:`ckptkit.ops.select`) chose and named: it renames entries and attaches row
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
from typing import Any

from ..core.manifest import TensorEntry
from ..errors import UsageError
from .apply import apply_preset
from .completeness import Source, listed
from .preset import Preset
from .registry import kin, preset as preset_named
from .shape import ModelShape

__all__ = ["KeyMapSource", "KeyMapping", "MappedKeys", "Renames", "key_mapping", "map_keys", "parse_rename",
           "read_json", "read_key_map", "rename_keys"]

Renames = Iterable[str | tuple[str, str]]
"""``--rename`` values: ``'REGEX=REPLACEMENT'`` strings, or (regex, replacement) pairs."""
KeyMapSource = Mapping[str, str | None] | Path | str | None
"""``--key-map``: old key to new key (None leaves it out), as a mapping, inline JSON of that (a string that
starts with ``{``), or the path of a JSON file of that."""
_SHOWN = 8
_MAX_OPTION_FILE = 64 << 20


@dataclass(frozen=True, kw_only=True)
class KeyMapping:
    """How to rename a model's keys, applied in this order: ``key_map``, ``renames``, ``preset``; and what the
    preset reads beside the keys. :func:`key_mapping` makes one from the command line's forms of each field."""

    key_map: tuple[tuple[str, str | None], ...] = ()
    """Exact key to new key; None leaves the key out."""
    renames: tuple[tuple[str, str], ...] = ()
    """(regular expression, replacement) pairs, applied in order with :func:`re.sub` to every key."""
    preset: str | None = None
    """A name in :data:`ckptkit.models.registry.PRESETS`, or ``"auto"`` (:mod:`ckptkit.models.detect`)."""
    strict: bool = False
    """Keys that neither the key map names nor a rename matches are an error (a preset always is strict)."""
    hf_assets: Path | str | None = None
    """An HF model directory whose ``config.json`` gives a preset the model's counts (default: the source's own)."""
    megatron_args: Mapping[str, Any] | None = None
    """Megatron-LM arguments a Megatron preset applies, over the source's own
    (:mod:`ckptkit.models.megatron_args`)."""

    def __post_init__(self) -> None:
        for pattern, _ in self.renames:
            try:
                re.compile(pattern)
            except re.error as e:
                raise UsageError(f"--rename {pattern!r}: not a regular expression ({e})") from None
        if self.preset is not None and self.preset != "auto":
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
    preset: str | None = None
    """The preset that mapped the keys (the one ``auto`` chose), or None."""


def parse_rename(text: str) -> tuple[str, str]:
    """``'REGEX=REPLACEMENT'`` split at the first ``=`` that is not part of the expression (``\\=``, ``(?=``,
    ``(?<=``, ``(?!=``, ``(?P=``)."""
    for i, c in enumerate(text):
        if c == "=" and (i == 0 or text[i - 1] not in "\\?<!P"):
            return text[:i], text[i + 1:]
    raise UsageError(f"--rename {text!r}: expected REGEX=REPLACEMENT, e.g. '^model\\.=' or 'attn\\.(\\w)_proj=\\1'")


def read_key_map(source: Path | str) -> tuple[tuple[str, str | None], ...]:
    """``--key-map``: a JSON object of old key to new key (``null``: leave the key out), given inline (text that
    starts with ``{``) or as the path of a file holding it.

    Raises:
        UsageError: not a JSON object of strings and nulls, or a file that cannot be read.
    """
    inline = isinstance(source, str) and source.lstrip().startswith("{")
    data = read_inline_json(source, "--key-map")
    if not isinstance(data, dict) or not all(isinstance(v, str) or v is None for v in data.values()):
        where = f"{str(source)!r:.80}" if inline else str(source)
        raise UsageError(f"--key-map {where}: expected a JSON object of old key to new key (or null to leave it out)")
    return tuple(data.items())


def key_mapping(*, preset: str | None = None, renames: Renames = (), key_map: KeyMapSource = None,
                strict: bool = False, hf_assets: Path | str | None = None,
                megatron_args: Mapping[str, Any] | None = None) -> KeyMapping:
    """A :class:`KeyMapping` from the library's and the CLI's arguments: ``renames`` as ``'REGEX=REPLACEMENT'``
    strings or pairs, ``key_map`` as a dict or the path of its JSON file, ``preset`` ``"none"`` as None.

    Raises:
        UsageError: a rename that is no regular expression, a key map that cannot be read, an unknown preset.
    """
    preset = None if preset == "none" else preset
    pairs = tuple(parse_rename(r) if isinstance(r, str) else (r[0], r[1]) for r in renames)
    table = read_key_map(key_map) if isinstance(key_map, (str, Path)) else tuple((key_map or {}).items())
    return KeyMapping(key_map=table, renames=pairs, preset=preset, strict=strict, hf_assets=hf_assets,
                      megatron_args=dict(megatron_args) if megatron_args else None)


def read_inline_json(source: str | Path, what: str) -> Any:
    """JSON an option (``what``) gives inline (text that starts with ``{``) or as the path of a small file.

    Args:
        source: The option's value.
        what: The option's name, for messages.

    Returns:
        The parsed JSON.

    Raises:
        UsageError: not valid JSON, or a file that cannot be read or is too large.
    """
    if isinstance(source, str) and source.lstrip().startswith("{"):
        try:
            return json.loads(source)
        except ValueError as e:
            raise UsageError(f"{what} {source!r:.80}: not valid JSON ({e})") from None
    return read_json(Path(source), what)


def read_json(path: Path, what: str):
    """A small JSON file named by an option (``what``), as untrusted input."""
    try:
        if path.stat().st_size > _MAX_OPTION_FILE:
            raise UsageError(f"{what} {path}: {path.stat().st_size} bytes is too large for a JSON file of names")
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{what} {path}: cannot read it as JSON ({e})") from e


_listed = listed


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
            raise UsageError(f"--strict-map: {len(unmapped)} key{'s' * (len(unmapped) != 1)} left unmapped: "
                             f"{_listed(unmapped)}")
    _check_collisions(current)
    names.update(current)
    return names, tuple(notes)


def _check_collisions(new_of: Mapping, origin_of: Mapping | None = None) -> None:
    """Refuses two keys (``new_of``: each item to its new name) that would get one name; ``origin_of`` names
    the items by the key they came from, where the items are not keys themselves."""
    origins: dict[str, str] = {}
    for item, new in new_of.items():
        old = origin_of[item] if origin_of is not None else item
        if not new and new != old:  # a key that was empty and stays so is no rename (torch saves '' keys)
            raise UsageError(f"key {old!r} would be renamed to an empty name")
        if new in origins:
            raise UsageError(f"keys {origins[new]!r} and {old!r} would both be named {new!r}")
        origins[new] = old


def map_keys(tensors: Iterable[TensorEntry], mapping: KeyMapping, *, shape: ModelShape | None = None,
             to_hf: bool | None = None, preset: Preset | None = None) -> MappedKeys:
    """``tensors`` renamed by ``mapping``. ``shape`` gives a preset its head counts (required by a preset with a
    transform); ``to_hf`` says which way a preset maps: towards HF names (True), or, when None, from whichever
    side the keys are named in to the other; ``preset`` is ``mapping.preset``'s table as the model's own
    arguments adjust it (:func:`ckptkit.models.resolve.resolve`), applied in its place.

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
        table = preset or preset_named(mapping.preset)
        adapted = apply_preset([Source(i.origin, i.entry) for i in items], table, shape, to_hf, kin(table))
        items = [_Item(s.origin, s.entry) for s in adapted.tensors]
        dropped += adapted.dropped
        notes += adapted.notes
    _check_collisions({id(i): i.entry.key for i in items}, {id(i): i.origin for i in items})
    original = {t.key: t.rows for t in tensors}
    renamed = tuple((i.origin, i.entry.key) for i in items if i.origin != i.entry.key)
    permuted = tuple(i.entry.key for i in items if i.entry.rows is not None and i.entry.rows != original.get(i.origin))
    return MappedKeys(tuple(i.entry for i in items), renamed, tuple(dropped), tuple(notes), permuted, mapping.preset)
